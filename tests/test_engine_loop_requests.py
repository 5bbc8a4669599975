"""The engine loop answers for a whole request (server/engine_loop.py): a request whose later
prompt the engine refuses, or whose step failed, leaves none of its prompts generating.
With the scripted stand-in engine of tests/test_server_engine_loop.py: the real engine's
refusals are met by the server before they reach this path."""

from test_server_engine_loop import FakeEngine

from pagedserve.engine import InvalidRequest, SamplingParams
from pagedserve.server.engine_loop import EngineLoop, ThreadInbox
from pagedserve.server.engine_messages import Add, Added


class RefusingEngine(FakeEngine):
    """Refuses a prompt that starts with token 0, as LLMEngine refuses a bad prompt."""

    def add_request(self, prompt, params, request_id):
        if prompt[:1] == [0]:
            raise InvalidRequest("refused", "prompt")
        return super().add_request(prompt, params, request_id)


def test_a_request_whose_later_prompt_is_refused_leaves_nothing_running():
    """All prompts of a request are queued or none: one the engine refuses takes the ones
    added before it back out, so that a 400 leaves no orphan generating in the engine."""
    engine = RefusingEngine()
    events = []
    loop = EngineLoop(lambda: engine, ThreadInbox(), events.extend)
    loop._add(engine, Add("g1", ["g1-0", "g1-1"], [[5, 6], [0, 7]],
                          SamplingParams(max_tokens=50)))
    (added,) = [e for e in loop.events if isinstance(e, Added)]
    assert isinstance(added.error, InvalidRequest)
    assert engine.requests == {} and loop.live == {} and loop.groups == {}


class PartlyFailingEngine(FakeEngine):
    """A failed step held only the first prompt's request (the others wait their turn)."""

    def fail_step(self):
        failed = sorted(self.requests)[:1]
        for request_id in failed:
            self.requests.pop(request_id)
        return failed, True


def test_a_failed_step_aborts_the_other_prompts_of_its_request():
    """A request whose prompt's step failed gets a 500 for all of it: the engine stops its
    other prompts too, rather than generate for a client that has its error."""
    engine = PartlyFailingEngine()
    events = []
    loop = EngineLoop(lambda: engine, ThreadInbox(), events.extend)
    loop._add(engine, Add("g1", ["g1-0", "g1-1"], [[5, 6], [7, 8]],
                          SamplingParams(max_tokens=50)))
    loop._add(engine, Add("g2", ["g2-0"], [[9]], SamplingParams(max_tokens=50)))
    assert loop._recover(engine)
    assert set(engine.requests) == {"g2-0"}
    assert set(loop.live) == {"g2-0"} and set(loop.groups) == {"g2"}
