"""Property test of the engine's scheduling and block accounting, driving the real engine on a tiny model.

Random arrivals (prompts from a few shared stems, so prefix hits happen), n > 1, stop strings, sampling and
greedy requests, aborts at any time and steps in between, on a pool small enough to force preemption, with
synchronous and asynchronous scheduling, on a classic decoder and on a hybrid one (whose sequences also hold a
slot of recurrent state each). After every operation the block manager's invariants hold (ref-counts = tables,
free pool = unreferenced blocks, registrations consistent, one state slot per live sequence) and no finished
sequence holds blocks; when everything has finished, every block and state slot is free and every request has a
finish reason.
"""

import functools

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.engine.scheduler import PENDING, Status
from tests.models import char_tokenizer, family_model, tiny_model

STEMS = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23], [40, 41, 42]]


@functools.cache
def _model(hybrid: bool):
    return hfaccel.accelerate(family_model("qwen3_next") if hybrid else tiny_model("llama"), attention="torch")


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        prefix_caching=st.booleans(),
        budget=st.sampled_from([3, 8, 64]),
        async_scheduling=st.booleans(),
        hybrid=st.booleans(),
    )
    def setup(self, prefix_caching, budget, async_scheduling, hybrid):
        self.engine = Engine(
            _model(hybrid),
            char_tokenizer(),
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            num_blocks=14,
            block_size=4,
            enable_prefix_caching=prefix_caching,
            async_scheduling=async_scheduling,
        )
        self.ids: list[str] = []

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(3, 95), max_size=10),
        max_tokens=st.integers(1, 10),
        n=st.integers(1, 3),
        sample=st.booleans(),
        stop=st.sampled_from([[], ["a"], ["e", "th"], ["xyz"]]),
    )
    def add(self, stem, tail, max_tokens, n, sample, stop):
        params = SamplingParams(
            max_tokens=max_tokens, n=n, temperature=1.0 if sample else 0, seed=len(self.ids), stop=stop
        )
        self.ids.append(self.engine.add_request(stem + tail, params))

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def abort(self, data):
        self.engine.abort(data.draw(st.sampled_from(self.ids)))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    @invariant()
    def blocks_are_accounted_for(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        manager = engine.scheduler.manager
        manager.check_invariants()
        live = {seq.seq_id for seq in engine.scheduler.running}
        assert set(manager.sequences()) == live, "only running sequences hold blocks"
        for request in engine.requests.values():
            for seq in request.seqs:
                assert PENDING not in seq.token_ids[: seq.num_known_tokens], "pending tokens are the last ones"
                assert len(seq.output.token_ids) <= request.params.max_tokens
                if seq.status is Status.FINISHED:
                    assert seq.output.finish_reason is not None and seq.num_pending == 0

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests(), "requests still unfinished after 500 steps"
        manager = engine.scheduler.manager
        assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
        assert manager.num_free_state_slots == manager.state_slots, "state slots leaked"
        manager.check_invariants()
        for request_id in self.ids:
            out = engine.snapshot(engine.requests[request_id])
            assert out.finished and len(out.outputs) in (1, engine.requests[request_id].params.n)
            assert all(o.finish_reason in ("stop", "length", "abort") for o in out.outputs)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
