"""The worker's thread tuner (services/worker/threads.py) on a made-up machine whose speed per
thread count changes mid-run, as when a CPU burner starts beside it and stops again."""

from meshserve.services.worker.threads import ThreadTuner


class Machine:
    """Seconds per step by thread count; `busy` is another process holding a core. Two cores: the one
    the steps do not use sits idle unless the burner holds it (what /proc/stat would say)."""

    def __init__(self):
        self.busy, self.now, self.threads, self.idle_s = False, 0.0, None, 0.0

    def idle(self) -> float:
        return self.idle_s

    def cost(self, n: int, tokens: int) -> float:
        one = 0.010 * max(1, tokens / 16)
        if n == 1:
            return one
        return one * (20.0 if self.busy else 0.6)  # two threads: faster when quiet, crawling when a core is taken

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now


def run(tuner: ThreadTuner, m: Machine, steps: int, tokens: int = 1) -> float:
    total = 0.0
    for _ in range(steps):
        def step():
            took = m.cost(m.threads, tokens)
            m.now += took
            if m.threads == 1 and not m.busy:
                m.idle_s += took

        before = m.now
        tuner.run(tokens, step)
        total += m.now - before
    return total


class Crawl(Machine):
    """Two threads beside a burner cost 50 one-thread steps (measured: 540 ms against 12.5)."""

    def cost(self, n, tokens):
        return 0.0125 * (50.0 if n == 2 and self.busy else 1.0 if n == 1 else 0.5)


def crawling(idle: bool, machine: type = Crawl) -> tuple[Machine, ThreadTuner]:
    """A quiet machine of that kind on two threads and its tuner (reading the machine's idle time or not)."""
    m = machine()
    m.threads = 2
    return m, ThreadTuner(2, m.set_threads, explore_every=32, clock=m.clock, idle=m.idle if idle else None)


def test_the_faster_count_wins_and_a_busy_core_is_noticed_both_ways():
    m = Machine()
    m.threads = 2  # the step thread's initial setting
    tuner = ThreadTuner(2, m.set_threads, explore_every=32, clock=m.clock, idle=m.idle)
    quiet = run(tuner, m, 320)
    best_quiet = 320 * m.cost(2, 1)
    assert quiet < best_quiet * 1.05  # within 5% of always running the faster count
    m.busy = True
    busy = run(tuner, m, 320)
    assert m.threads == 1 and busy < 320 * m.cost(2, 1) * 20 * 0.25  # it left 2 threads
    ones_before = tuner.chosen[1]
    m.busy = False
    run(tuner, m, 320)
    assert m.threads == 2 and tuner.chosen[1] - ones_before < 320 * 0.2  # and came back


def test_exploring_more_threads_beside_a_burner_costs_at_most_its_share():
    """Beside a burner a two-thread step costs 50 one-thread ones (measured: 540 ms against 12.5).
    Exploring it every 32 steps would triple the time; within the budget it costs about 5%."""

    m, tuner = crawling(idle=True)
    run(tuner, m, 100)
    m.busy = True
    run(tuner, m, 10)  # the burner is noticed: one thread from here on
    assert tuner.current == 1
    twos = tuner.chosen[2]
    busy = run(tuner, m, 3000)
    assert busy < 3000 * 0.0125 * (1 + 0.05 + 0.02)
    assert tuner.chosen[2] - twos >= 2  # it did keep looking (3000 steps' 5% is 3 explorations)


def test_a_core_coming_back_is_seen_from_its_idle_time_and_a_wrong_sign_backs_off():
    """The budget alone would notice a free core only after many steps; the cores' idle time says
    so at once. Where the idle time misleads (a quota, not a neighbour, holds the core), the
    explorations it causes thin out."""

    m, tuner = crawling(idle=True)
    run(tuner, m, 100)
    m.busy = True
    run(tuner, m, 500)
    m.busy = False
    ones = tuner.chosen[1]
    run(tuner, m, 100)
    assert tuner.current == 2 and tuner.chosen[1] - ones <= 32  # within a window (0.1 s) or so

    m.busy = True
    run(tuner, m, 50)
    assert tuner.current == 1
    m.idle = lambda: m.now  # the other core looks idle all the time, but two threads still crawl
    twos = tuner.chosen[2]
    busy = run(tuner, m, 4000)
    assert tuner.current == 1 and tuner.chosen[2] - twos <= 12  # doubling waits: 32, 64, ..., 2048
    assert busy < 4000 * 0.0125 * 1.25


def test_without_idle_times_a_free_core_is_still_found_by_the_budget():
    m, tuner = crawling(idle=False)
    run(tuner, m, 100)
    m.busy = True
    run(tuner, m, 500)
    m.busy = False
    run(tuner, m, 2000)  # 50 steps' worth of budget is 1000 steps at 5%
    assert tuner.current == 2


def test_steps_of_different_sizes_are_measured_apart():
    m = Machine()
    m.threads = 2
    tuner = ThreadTuner(2, m.set_threads, explore_every=8, clock=m.clock)
    run(tuner, m, 50, tokens=1)
    run(tuner, m, 50, tokens=512)
    assert {b for b, _ in tuner.avg} == {ThreadTuner.bucket(1), ThreadTuner.bucket(512)}


def test_a_size_not_measured_yet_runs_first_on_the_count_running_now():
    """A mesh's first prompt of some length is not the one-thread try: on a quiet machine it runs on
    all the cores (the count the other sizes found best), and one thread is tried on the next."""
    m = Machine()
    m.threads = 2
    tuner = ThreadTuner(2, m.set_threads, explore_every=8, clock=m.clock)
    run(tuner, m, 40, tokens=1)
    used = []

    def step(tokens):
        used.append(m.threads)
        m.now += m.cost(m.threads, tokens)

    for _ in range(2):
        tuner.run(300, lambda: step(300))
    assert used == [2, 1]
    m.busy = True  # a burner: one thread is best now, and a new size starts there
    run(tuner, m, 40, tokens=1)
    assert tuner.current == 1
    tuner.run(40, lambda: step(40))
    assert used[-1] == 1


def test_one_core_means_nothing_to_choose():
    m = Machine()
    m.threads = 1
    tuner = ThreadTuner(1, m.set_threads, clock=m.clock)
    run(tuner, m, 10)
    assert tuner.candidates == [1] and tuner.chosen == {1: 10}



def test_steps_of_one_bucket_but_different_sizes_are_compared_per_token():
    """Sizes 256 and 511 share a bucket and alternate (a mixed load). Two threads are faster per
    token; an exploring one-thread sample of the small size must not look faster than the
    two-thread average of both sizes (compared per step, it would, and win for a while)."""

    class PerToken(Machine):
        def cost(self, n, tokens):
            return tokens * (0.0010 if n == 1 else 0.0007)

    m = PerToken()
    m.threads = 2
    tuner = ThreadTuner(2, m.set_threads, explore_every=8, clock=m.clock)
    total = sum(run(tuner, m, 1, tokens=t) for _ in range(400) for t in (256, 511))
    explore_cost = (800 / 8) * 256 * 0.0003  # every eighth step of the bucket on one thread
    best = 400 * (256 + 511) * 0.0007
    assert total < best + explore_cost * 1.5


def test_a_quiet_machine_explores_less_and_less_but_a_burner_is_seen_on_the_next_step():
    """Quiet: one-thread explorations of big steps back off (they cost twice a two-thread step).
    A burner taking a core makes the very next step explore, whatever the interval."""
    m = Machine()
    m.threads = 2
    tuner = ThreadTuner(2, m.set_threads, explore_every=32, clock=m.clock)
    run(tuner, m, 2000, tokens=512)
    assert tuner.chosen[1] < 2000 * 0.01  # one step in 32 would be 62
    m.busy = True
    run(tuner, m, 3, tokens=512)  # the first is slow on two threads, the second explores one
    assert tuner.current == 1


def test_idle_seconds_reads_this_machines_cores():
    """The idle-core sign's source: /proc/stat's idle time of the given cores, cumulative; a core set
    that names no core reads 0."""
    import os

    from meshserve.services.worker.threads import idle_seconds

    cores = sorted(os.sched_getaffinity(0))
    first = idle_seconds(cores)
    assert isinstance(first, float) and first > 0
    assert idle_seconds(cores) >= first
    assert idle_seconds(cores[:1]) > 0 and idle_seconds([]) == 0.0


def test_a_first_slow_step_on_a_woken_team_does_not_prove_the_sign_wrong():
    """After a stretch on one thread, the first step on two pays for waking the second thread (here
    3x); the one after it shows the real speed. The idle sign's exploration takes both before it
    calls the sign wrong, so the stream is back on both cores at once, not after a backed-off wait."""

    class Waking(Crawl):
        last = 2

        def cost(self, n, tokens):
            woke = n == 2 and self.last == 1
            self.last = n
            return super().cost(n, tokens) * (3.0 if woke else 1.0)

    m, tuner = crawling(idle=True, machine=Waking)
    run(tuner, m, 100)
    m.busy = True
    run(tuner, m, 300)
    assert tuner.current == 1
    m.busy = False
    ones = tuner.chosen[1]
    run(tuner, m, 40)
    assert tuner.current == 2 and tuner.chosen[1] - ones <= 12
    assert tuner.explored["idle_signs_wrong"] == 0


def test_the_idle_sign_sees_through_the_workers_own_pauses():
    """Short requests: two steps, then a 30 ms pause for the next. In a pause the worker's own core
    sits idle too, which is not a free core: beside a burner no sign comes of it, and once the
    burner is gone the sign comes although no 0.1 s ran without a pause."""

    def requests(tuner, m, count):
        for _ in range(count):
            run(tuner, m, 2)
            m.now += 0.030
            m.idle_s += 0.030 * (1 if m.busy else 2)  # the worker's core; the other one too when quiet

    m, tuner = crawling(idle=True)
    requests(tuner, m, 20)
    m.busy = True
    requests(tuner, m, 300)
    assert tuner.current == 1 and tuner.explored["more_on_idle_cores"] == 0
    m.busy = False
    ones = tuner.chosen[1]
    requests(tuner, m, 20)
    assert tuner.current == 2 and tuner.chosen[1] - ones <= 8
