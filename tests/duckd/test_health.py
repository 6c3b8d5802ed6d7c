"""duckd.health.StepWatch's rule on its own: healthy while the engine has nothing to do or makes
progress (tokens out, fleet calls ended); a stall past stall_after_s while requests are held is
NOT_SERVING, said once; progress again is healthy again. (The daemon cannot be made to stall
for real any more: tests/duckd/test_lost_duck.py holds that it does not.)"""
from types import SimpleNamespace

from duckd.health import StepWatch


class _Transport:
    def __init__(self):
        self.mark = 0

    def progress(self):
        return self.mark


def _daemon():
    return SimpleNamespace(ready=True, chat=SimpleNamespace(tokens_out=0, running=0, queued=0),
                           transport=_Transport())


def test_a_stall_with_work_held_is_unhealthy_until_progress_again():
    d = _daemon()
    w = StepWatch(d, stall_after_s=5.0)
    assert not w.check(now=0.0) and w.ok
    assert not w.check(now=100.0) and w.ok                 # idle for long: nothing expected of it
    d.chat.running = 3
    assert not w.check(now=101.0)
    assert not w.check(now=104.9) and w.ok                 # 4.9 s since it was last seen idle: within the bound
    d.transport.mark += 1                                  # a fleet call ended (a long prefill's layer)
    assert not w.check(now=106.0)
    assert not w.check(now=110.9) and w.ok
    assert w.check(now=111.1) and not w.ok                 # 5.1 s still: stalled, said once
    assert "no step progress for 5.1 s while 3 request(s)" in w.stalled
    assert not w.check(now=130.0) and not w.ok
    d.chat.tokens_out += 1
    assert w.check(now=131.0) and w.ok


def test_a_daemon_not_ready_or_without_work_never_stalls():
    d = _daemon()
    d.transport = None
    d.chat.queued = 1
    w = StepWatch(d, stall_after_s=1.0)
    d.ready = False                                         # starting or stopping
    assert not w.check(now=0.0) and not w.check(now=50.0) and w.ok
    d.ready = True
    assert not w.check(now=50.5)
    assert w.check(now=52.0) and not w.ok
    d.chat.queued = 0                                        # the held request left (its caller went away)
    assert w.check(now=53.0) and w.ok
