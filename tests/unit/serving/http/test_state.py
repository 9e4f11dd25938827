"""The API's shared state: a structured spec whose grammar check outlasts --max-grammar-compile-s
is refused with a 400 naming the field, and so is the same spec afterwards, at once, while another
spec is checked as usual."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError
from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.state import ServingState, StructuredOptions
from tests.support.fake_engine import MODEL, FakeEngine


class GatedGrammars:
    """validate() of the regex "slow" waits until released; "bad" is refused; the rest pass."""

    def __init__(self):
        self.release = threading.Event()
        self.calls: list[str] = []

    def validate(self, spec: StructuredSpec) -> None:
        self.calls.append(spec.value)
        if spec.value == "slow":
            assert self.release.wait(60), "never released"
        if spec.value == "bad":
            raise StructuredSpecError("regex", "invalid regex: unbalanced")


def regex(value: str) -> SamplingParams:
    return SamplingParams(structured=StructuredSpec.from_kind("regex", value))


def test_a_slow_grammar_check_is_a_400_and_its_spec_is_refused_at_once_from_then_on():
    state = ServingState(FakeEngine(), MODEL, structured=StructuredOptions(max_grammar_compile_s=0.2))
    grammars = state.grammars = GatedGrammars()

    async def go():
        try:
            await checks()
        finally:
            grammars.release.set()  # the slow check's thread ends (asyncio.run waits for it)

    async def checks():
        with pytest.raises(ProtocolError, match=r"guided_regex: compiling its grammar took over 0.2 s") as slow:
            await state.check_structured(regex("slow"), "guided_regex")
        assert slow.value.field == "guided_regex"
        with pytest.raises(ProtocolError, match="took over 0.2 s"):
            await state.check_structured(regex("slow"), "response_format")  # refused without a new check
        await state.check_structured(regex("fast"), "guided_regex")
        with pytest.raises(ProtocolError, match="guided_regex: invalid regex: unbalanced"):
            await state.check_structured(regex("bad"), "guided_regex")
        await state.check_structured(SamplingParams(), None)  # nothing to check

    asyncio.run(go())
    assert grammars.calls == ["slow", "fast", "bad"]
