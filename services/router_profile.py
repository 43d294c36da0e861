"""`POST /start_profile` and `POST /stop_profile`, as SGLang serves them (vLLM's are the same
two without a body): the torch profiler on every live worker (services/worker_profile.py).

The start's body is optional: `output_dir` (on the workers' machines; default their
`--profile-dir`), `num_steps` (stop by itself after that many scheduler steps), `activities`
("CPU", "GPU", "MEM"; default CPU and GPU), `with_stack`, `record_shapes` and `profile_id`
(the trace files' first part). SGLang's `profile_by_stage`, `merge_profiles` and
`start_step` are refused unless off. The answer names each worker's trace file; the stop's
lists the files written. A worker that refuses (already profiling, not profiling, a folder
it cannot make) makes it a 400 with its reason, one that does not answer a 503.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from pydantic import BeforeValidator, Field

from services.router_control import ask_all_workers
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from shared.messages import ProfileReqMsg
from shared.messages.worker import PROFILE_ACTIVITIES

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 120.0  # writing a long GPU trace takes a while


def _int_text(value: Any) -> Any:
    """SGLang's profiler client sends `num_steps` as a string."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


class ProfileBody(_Strict):
    output_dir: str | None = None
    num_steps: Annotated[int | None, BeforeValidator(_int_text), Field(ge=1)] = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    start_step: int | None = None

    def check(self) -> None:
        unknown = [a for a in self.activities or [] if a not in PROFILE_ACTIVITIES]
        if unknown:
            raise ApiError(400, f"unknown activities {unknown} (use "
                                f"{', '.join(PROFILE_ACTIVITIES)})", "activities",
                           "invalid_value")  # fmt: skip
        for name in ("profile_by_stage", "merge_profiles", "start_step"):
            if getattr(self, name) not in (False, None):
                raise ApiError(400, f"{name} is not supported", name, "unsupported_parameter")


async def _ask(router: Any, question: Any, timeout_s: float, what: str) -> dict[str, Any]:
    failure, code = f"profiling not {what}", f"profile_not_{what}"
    return await ask_all_workers(router.broker, question, timeout_s, failure, code)


def add_routes(app: Any, state: dict[str, Any]) -> None:
    @app.post("/start_profile")
    async def start_profile(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(ProfileBody, (await request.body()).strip() or b"{}")
        body.check()

        def question(request_id: str) -> ProfileReqMsg:
            return ProfileReqMsg(
                request_id, router.broker.router_id, "start", body.output_dir or "",
                body.num_steps or 0, body.activities or [], bool(body.with_stack),
                bool(body.record_shapes), body.profile_id or "",
            )  # fmt: skip

        replies = await _ask(router, question, START_TIMEOUT_S, "started")
        return {"success": True, "message": "Start profiling.",
                "workers": {w: r.message for w, r in sorted(replies.items())}}  # fmt: skip

    @app.post("/stop_profile")
    async def stop_profile(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)

        def question(request_id: str) -> ProfileReqMsg:
            return ProfileReqMsg(request_id, router.broker.router_id, "stop")

        replies = await _ask(router, question, STOP_TIMEOUT_S, "stopped")
        return {"success": True, "message": "Stop profiling.",
                "traces": {w: r.paths for w, r in sorted(replies.items())}}  # fmt: skip
