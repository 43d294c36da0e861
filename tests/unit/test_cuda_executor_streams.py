"""The CUDA overlap executor's stream switch (`_OnStream`), on the CPU with torch.cuda's stream
functions stood in for: the current stream of the device becomes the given one inside and is
restored after (an exception too), looked up by the stream's own device index."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.overlap import cuda_executor


@pytest.fixture
def streams(monkeypatch):
    current = {1: SimpleNamespace(device_index=1, name="scheduler")}
    asked: list[object] = []

    def current_stream(device=None):  # noqa: ANN001, ANN202
        asked.append(device)
        return current[device]

    def set_stream(stream):  # noqa: ANN001, ANN202
        current[stream.device_index] = stream

    monkeypatch.setattr(cuda_executor.torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(cuda_executor.torch.cuda, "set_stream", set_stream)
    return current, asked


def test_the_stream_is_current_inside_and_restored_after(streams):
    current, asked = streams
    scheduler = current[1]
    forward = SimpleNamespace(device_index=1, name="forward")
    with cuda_executor._OnStream(forward):
        assert current[1] is forward
        copy = SimpleNamespace(device_index=1, name="copy")
        with cuda_executor._OnStream(copy):
            assert current[1] is copy
        assert current[1] is forward
    assert current[1] is scheduler
    assert asked == [1, 1]  # by index: no lookup of the current device


def test_restored_after_an_exception(streams):
    current, _ = streams
    scheduler = current[1]
    with pytest.raises(RuntimeError), cuda_executor._OnStream(SimpleNamespace(device_index=1)):
        raise RuntimeError("a launch failed")
    assert current[1] is scheduler
