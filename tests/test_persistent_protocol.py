"""A model of the persistent kernel's synchronisation, explored over random interleavings (CPU).

``cute_kernels/sm90/sparse_prefill.py`` with ``persistent=True`` walks several tiles per CTA with the
same mbarriers and named barriers, so a wait can alias an older or newer phase, or a named barrier can
complete with two arrivals of one consumer, only through an ordering the GPU rarely produces. The
model below restates the kernel's waits, arrivals, buffer writes and buffer reads, actor by actor
(the producer's first-block warps with the Q loads, its second-block warps, consumer 0, consumer 1:
one actor per arrival unit of the barriers), and runs them under random schedules. It checks:

- no deadlock;
- every mbarrier wait succeeds on exactly the phase it means (no parity aliasing);
- every named-barrier generation gets one arrival from each consumer;
- every read of a shared buffer (Q, KV tiles, P buffers, the running max, the row statistics) sees the
  write of its own tile or block.

It must change with the kernel's protocol; ``test_the_model_finds_the_empty_tile_race`` shows it
catches the race fixed in commit 6d4d65c (an empty tile's statistics published too early).
"""

import random

import pytest

from cute_kernels.sm90.named_barrier import NamedBarrierFp8
from cute_kernels.sm90.sparse_prefill import NUM_KV_TILES, consumer_steps

# named barrier ids of the kernel (STATS + c: consumer c's statistics)
STATS, HANDOFF = int(NamedBarrierFp8.StatsPublished0), int(NamedBarrierFp8.TileHandoff)


class ProtocolError(AssertionError):
    pass


class MBarrier:
    def __init__(self, name: str, arrivals: int):
        self.name, self.arrivals, self.pending, self.completed = name, arrivals, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.arrivals:
            self.pending, self.completed = 0, self.completed + 1

    def ready(self, parity: int) -> bool:  # mbarrier.try_wait.parity
        return self.completed % 2 != parity


class Model:
    def __init__(self, tiles: list[int], empty_tile_sync: bool = True):
        self.tiles, self.empty_tile_sync = tiles, empty_tile_sync
        ring = range(NUM_KV_TILES)
        self.mbar = {
            "q_full": MBarrier("q_full", 1),
            "q_empty": MBarrier("q_empty", 2),
            **{f"kv_full{i}": MBarrier(f"kv_full{i}", 1) for i in ring},
            **{f"kv_empty{i}": MBarrier(f"kv_empty{i}", 2) for i in ring},
            **{f"p_full{i}": MBarrier(f"p_full{i}", 1) for i in ring},
        }
        self.named = {i: [0, set()] for i in (STATS, STATS + 1, HANDOFF)}  # generation, arrived
        self.data: dict[str, object] = {}

    # One program per actor: generators of operations.
    def wait(self, bar: str, index: int):
        """Wait for phase ``index`` of ``bar`` (index -1: the one before the first, already done)."""
        return ("wait", bar, index)

    def producer(self, half: int):
        pair_base = 0
        for tile, blocks in enumerate(self.tiles):
            if half == 0:  # warp 0 loads Q once both consumers' QKs of the previous tile are done
                yield self.wait("q_empty", tile - 1)
                yield ("write", "sQ", tile)
                yield ("arrive", "q_full")
            for pair in range((blocks + 1) // 2):
                ring_pair = pair_base + pair
                kv = (ring_pair % 2) * 2 + half
                yield self.wait(f"kv_empty{kv}", ring_pair // 2 - 1)
                yield ("write", f"kv{kv}", 2 * ring_pair + half)
                yield ("arrive", f"kv_full{kv}")
            pair_base += (blocks + 1) // 2

    def consumer(self, c: int):
        pair_base = 0
        for tile, blocks in enumerate(self.tiles):
            base = 2 * pair_base
            yield self.wait("q_full", tile)
            if blocks <= c:
                yield ("arrive", "q_empty")
            if tile > 0:
                if c == 1 and (blocks > 0 or not self.empty_tile_sync):
                    yield ("arrive_named", HANDOFF)
                elif blocks == 0:
                    yield from self.sync(HANDOFF)
            if blocks > 0:
                for step in range(consumer_steps(blocks, c)):
                    own = 2 * step + c
                    if own < blocks:
                        g = base + own
                        yield self.wait(f"kv_full{g % 4}", g // 4)
                        yield ("read", "sQ", tile)
                        yield ("read", f"kv{g % 4}", g)
                        if own + 2 >= blocks:
                            yield ("arrive", "q_empty")
                        if own == 0 and tile > 0:
                            yield from self.sync(HANDOFF)
                        if own > 0:
                            yield self.wait(f"p_full{(g - 1) % 4}", (g - 1) // 4)
                            yield ("read", f"max{(g - 1) % 4}", g - 1)
                        yield ("write", f"P{g % 4}", g)
                        yield ("write", f"max{g % 4}", g)
                        yield ("arrive", f"p_full{g % 4}")
                        if own + 2 >= blocks:
                            yield ("write", f"stats{c}", tile)
                            yield ("arrive_named", STATS + c)
                    products = []
                    if own - 1 >= 0:
                        gp = base + own - 1
                        yield self.wait(f"p_full{gp % 4}", gp // 4)
                        yield self.wait(f"kv_full{gp % 4}", gp // 4)
                        yield ("read", f"max{gp % 4}", gp)
                        products.append(gp)
                        if own < blocks:
                            go = base + own
                            yield self.wait(f"p_full{go % 4}", go // 4)
                            yield ("read", f"max{go % 4}", go)
                    if own < blocks:
                        products.append(base + own)
                    for g in products:
                        yield ("read", f"P{g % 4}", g)
                        yield ("read", f"kv{g % 4}", g)
                        yield ("arrive", f"kv_empty{g % 4}")
            if blocks <= c:
                yield ("write", f"stats{c}", tile)
                yield ("arrive_named", STATS + c)
            if blocks % 2 == 1:  # the last pair's zero-filled second block
                e = base + blocks
                yield self.wait(f"kv_full{e % 4}", e // 4)
                yield ("arrive", f"kv_empty{e % 4}")
                if c == 1:
                    yield ("arrive", f"p_full{e % 4}")
            yield from self.sync(STATS + 1 - c)
            yield ("read", "stats0", tile)
            yield ("read", "stats1", tile)
            if blocks > 0:
                last = base + blocks - 1
                yield ("read", f"max{last % 4}", last)
            pair_base += (blocks + 1) // 2

    def sync(self, barrier: int):
        yield ("arrive_named", barrier)
        yield ("wait_named", barrier)

    # The scheduler.
    def run(self, rng: random.Random) -> None:
        actors = {
            "producer first blocks": self.producer(0),
            "producer second blocks": self.producer(1),
            "consumer 0": self.consumer(0),
            "consumer 1": self.consumer(1),
        }
        pending = {name: next(program, None) for name, program in actors.items()}
        waiting_generation: dict[str, int] = {}
        while any(op is not None for op in pending.values()):
            runnable = [
                name
                for name, op in pending.items()
                if op is not None and self.ready(name, op, waiting_generation)
            ]
            if not runnable:
                raise ProtocolError(f"deadlock: {pending}")
            name = rng.choice(runnable)
            self.execute(name, pending[name], waiting_generation)
            pending[name] = next(actors[name], None)

    def ready(self, name, op, waiting_generation) -> bool:
        if op[0] == "wait":
            return self.mbar[op[1]].ready(op[2] % 2)
        if op[0] == "wait_named":
            return self.named[op[1]][0] > waiting_generation[name]
        return True

    def execute(self, name, op, waiting_generation) -> None:
        kind = op[0]
        if kind == "wait":
            bar = self.mbar[op[1]]
            if bar.completed != op[2] + 1:
                raise ProtocolError(f"{name}: waited for phase {op[2]} of {op[1]}, {bar.completed} completed")
        elif kind == "arrive":
            self.mbar[op[1]].arrive()
        elif kind == "arrive_named":
            generation, arrived = self.named[op[1]]
            if name in arrived:
                raise ProtocolError(f"{name}: second arrival on named barrier {op[1]} in one generation")
            arrived.add(name)
            waiting_generation[name] = generation
            if len(arrived) == 2:
                self.named[op[1]] = [generation + 1, set()]
        elif kind == "write":
            self.data[op[1]] = op[2]
        elif kind == "read":
            if self.data.get(op[1]) != op[2]:
                raise ProtocolError(f"{name}: read {op[1]} expecting {op[2]}, found {self.data.get(op[1])}")


def random_tiles(rng: random.Random) -> list[int]:
    return [rng.choice([0, 0, 1, 2, 3, 4, 5, 7, 8, 9]) for _ in range(rng.randint(1, 6))]


def test_random_tiles_and_schedules_keep_the_protocol():
    """3000 runs: 300 random tile sequences, 10 random schedules each (a violation raises)."""
    rng = random.Random(20261129)
    for _ in range(300):
        tiles = random_tiles(rng)
        for _ in range(10):
            Model(tiles).run(rng)


@pytest.mark.parametrize("tiles", [[0], [1], [2, 0, 0, 3], [5, 1, 0, 8], [9, 9, 9]])
def test_edge_tile_sequences_keep_the_protocol(tiles):
    rng = random.Random(7)
    for _ in range(500):
        Model(tiles).run(rng)


def test_the_model_finds_the_empty_tile_race():
    """Without the handoff sync of an empty tile (the kernel before 6d4d65c), consumer 1 can publish
    the empty tile's statistics before consumer 0 has read the previous tile's."""
    rng = random.Random(1)
    failures = 0
    for _ in range(2000):
        try:
            Model([4, 0, 3], empty_tile_sync=False).run(rng)
        except ProtocolError:
            failures += 1
    assert failures > 0
