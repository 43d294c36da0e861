"""Message types, one module per destination (as mini-sglang splits them).

| module        | stream                 | types                                 |
|---------------|------------------------|---------------------------------------|
| `tokenizer`   | `{p}:tokenize`         | TokenizeReqMsg (ChatMessage)          |
| `worker`      | `{p}:worker:{w}:in`    | GenerateReqMsg, AbortReqMsg, FlushCacheReqMsg, |
|               |                        | ProfileReqMsg, LoraReqMsg,            |
|               |                        | UpdateWeightsReqMsg, PauseReqMsg,     |
|               |                        | MemoryReqMsg, WeightsGroupReqMsg,     |
|               |                        | DistributedWeightsReqMsg,             |
|               |                        | WeightsReadReqMsg                     |
| `detokenizer` | `{p}:detok`            | StepOutputMsg (StepRow)               |
| `router`      | `{p}:router:{r}:out`   | DetokOutputMsg (DetokRow), ErrorMsg, FlushCacheRespMsg, |
|               |                        | TokenizeRespMsg, AbortNamedMsg,       |
|               |                        | AbortNamedRespMsg, ProfileRespMsg,    |
|               |                        | LoraRespMsg, UpdateWeightsRespMsg,    |
|               |                        | PauseRespMsg, MemoryRespMsg,          |
|               |                        | WeightsReadRespMsg                    |
| `status`      | heartbeat keys         | WorkerLoadMsg, ServiceStatusMsg       |

`msg.to_msg()` encodes; `decode_message(data)` decodes any type, `Cls.from_msg(data)` one
type; both raise `MessageError` for anything invalid. See `base` for the wire format.
"""

from shared.messages.base import Message, Record, decode_message, message_types
from shared.messages.common import DETOK_WINDOW_LEN, FinishReason, PromptLogprobs
from shared.messages.detokenizer import StepOutputMsg, StepRow
from shared.messages.router import (
    AbortNamedMsg,
    AbortNamedRespMsg,
    DetokOutputMsg,
    DetokRow,
    ErrorMsg,
    FlushCacheRespMsg,
    LoraRespMsg,
    MemoryRespMsg,
    PauseRespMsg,
    ProfileRespMsg,
    TokenizeRespMsg,
    UpdateWeightsRespMsg,
    WeightsReadRespMsg,
)
from shared.messages.schema import MessageError
from shared.messages.status import ServiceStatusMsg, WorkerLoadMsg
from shared.messages.tokenizer import ChatMessage, TokenizeReqMsg
from shared.messages.worker import (
    AbortReqMsg,
    DistributedWeightsReqMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    LoraReqMsg,
    MemoryReqMsg,
    PauseReqMsg,
    ProfileReqMsg,
    UpdateWeightsReqMsg,
    WeightsGroupReqMsg,
    WeightsReadReqMsg,
)

__all__ = [
    "DETOK_WINDOW_LEN",
    "AbortNamedMsg",
    "AbortNamedRespMsg",
    "AbortReqMsg",
    "DistributedWeightsReqMsg",
    "ChatMessage",
    "DetokOutputMsg",
    "DetokRow",
    "ErrorMsg",
    "FinishReason",
    "FlushCacheReqMsg",
    "FlushCacheRespMsg",
    "GenerateReqMsg",
    "LoraReqMsg",
    "LoraRespMsg",
    "Message",
    "MessageError",
    "PauseReqMsg",
    "PauseRespMsg",
    "MemoryReqMsg",
    "MemoryRespMsg",
    "ProfileReqMsg",
    "ProfileRespMsg",
    "PromptLogprobs",
    "Record",
    "ServiceStatusMsg",
    "StepOutputMsg",
    "TokenizeRespMsg",
    "StepRow",
    "TokenizeReqMsg",
    "UpdateWeightsReqMsg",
    "WeightsGroupReqMsg",
    "WeightsReadReqMsg",
    "WeightsReadRespMsg",
    "UpdateWeightsRespMsg",
    "WorkerLoadMsg",
    "decode_message",
    "message_types",
]
