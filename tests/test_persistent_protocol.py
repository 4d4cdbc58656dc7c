"""A model of the persistent kernel's synchronisation, explored over random interleavings (CPU).

``cute_kernels/sm90/sparse_prefill.py`` with ``persistent=True`` walks several tiles per CTA with the
same mbarriers, so a wait can alias an older or newer phase, or a buffer be rewritten before it is read,
only through an ordering the GPU rarely produces. The model below restates the kernel's waits,
arrivals, buffer writes and buffer reads, actor by actor (the producer's first-block warps with the Q
loads, its second-block warps, consumer 0, consumer 1: one actor per arrival unit of the barriers; the
128 arrivals of a consumer warpgroup on ``p_full``, ``stats_full`` or ``tile_done`` are one), and runs
them under random schedules. It checks:

- no deadlock;
- every mbarrier wait succeeds on exactly the phase it means (no parity aliasing);
- every read of a shared buffer (Q, KV tiles, P buffers, the running max, the row statistics) sees the
  write of its own tile or block.

``Model(staged_q=True)`` is the kernel with a bf16 q (``stage_q``): a tile's bf16 rows take the KV ring's
pair slot before its first pair, filled by the producer like a pair and quantised into sQ by both consumers
(each half of the rows), which release the slot (``kv_empty``; consumer c completes the ``p_full`` phase of
the slot's block position c, the other waits for it) and arrive on ``q_full``.

It must change with the kernel's protocol. ``Model(drop=...)`` leaves one of the kernel's waits out;
the ``test_the_model_finds_*`` tests show that the model then finds the race that wait prevents.
"""

import random

import pytest

from cute_kernels.sm90.sparse_prefill import NUM_KV_TILES, consumer_steps

# The hand-over waits ``Model(drop=...)`` can leave out.
TILE_DONE = "consumer 0 waits for tile_done of the previous tile"
EMPTY_TILE_STATS = "consumer 1, in a tile without blocks, waits for stats_full[0] before publishing"
EPILOGUE_STATS = "the epilogue waits for the other consumer's stats_full"
STAGED_Q_FULL = "staged q: the consumers wait for the slot's kv_full before reading the rows"


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
    def __init__(self, tiles: list[int], drop: str | None = None, staged_q: bool = False):
        self.tiles, self.drop, self.staged_q = tiles, drop, staged_q
        self.q_pairs = 1 if staged_q else 0  # the ring's pair positions a tile's Q takes
        ring = range(NUM_KV_TILES)
        self.mbar = {
            "q_full": MBarrier("q_full", 2 if staged_q else 1),
            "q_empty": MBarrier("q_empty", 2),
            **{f"kv_full{i}": MBarrier(f"kv_full{i}", 1) for i in ring},
            **{f"kv_empty{i}": MBarrier(f"kv_empty{i}", 2) for i in ring},
            **{f"p_full{i}": MBarrier(f"p_full{i}", 1) for i in ring},
            **{f"stats_full{c}": MBarrier(f"stats_full{c}", 1) for c in range(2)},
            "tile_done": MBarrier("tile_done", 1),
        }
        self.data: dict[str, object] = {}

    # One program per actor: generators of operations.
    def wait(self, bar: str, index: int):
        """Wait for completion ``index`` (0, 1, ...) of ``bar`` (index -1: the one before the first,
        already done): phase ``index % 2``."""
        return ("wait", bar, index)

    def producer(self, half: int):
        pair_base = 0
        for tile, blocks in enumerate(self.tiles):
            if self.staged_q:  # the tile's bf16 rows into the pair slot of position pair_base
                kv = (pair_base % 2) * 2 + half
                yield self.wait(f"kv_empty{kv}", pair_base // 2 - 1)
                yield ("write", f"kv{kv}", ("q", tile))
                yield ("arrive", f"kv_full{kv}")
            elif half == 0:  # warp 0 loads Q once both consumers' QKs of the previous tile are done
                yield self.wait("q_empty", tile - 1)
                yield ("write", "sQ0", tile)
                yield ("write", "sQ1", tile)
                yield ("arrive", "q_full")
            for pair in range((blocks + 1) // 2):
                ring_pair = pair_base + self.q_pairs + pair
                kv = (ring_pair % 2) * 2 + half
                yield self.wait(f"kv_empty{kv}", ring_pair // 2 - 1)
                yield ("write", f"kv{kv}", 2 * ring_pair + half)
                yield ("arrive", f"kv_full{kv}")
            pair_base += (blocks + 1) // 2 + self.q_pairs

    def consumer(self, c: int):
        pair_base = 0
        for tile, blocks in enumerate(self.tiles):
            base = 2 * (pair_base + self.q_pairs)
            if self.staged_q:
                yield from self.quantize_staged_q(c, tile, base - 2)
            yield self.wait("q_full", tile)
            if blocks <= c:
                yield ("arrive", "q_empty")
            if blocks > 0:
                for step in range(consumer_steps(blocks, c)):
                    own = 2 * step + c
                    if own < blocks:
                        g = base + own
                        yield self.wait(f"kv_full{g % 4}", g // 4)
                        yield ("read", "sQ0", tile)
                        yield ("read", "sQ1", tile)
                        yield ("read", f"kv{g % 4}", g)
                        if own + 2 >= blocks:
                            yield ("arrive", "q_empty")
                        if own == 0:
                            yield from self.wait_previous_tile(tile)
                        if own > 0:
                            yield self.wait(f"p_full{(g - 1) % 4}", (g - 1) // 4)
                            yield ("read", f"max{(g - 1) % 4}", g - 1)
                        yield ("write", f"P{g % 4}", g)
                        yield ("write", f"max{g % 4}", g)
                        yield ("arrive", f"p_full{g % 4}")
                        if own + 2 >= blocks:
                            yield from self.publish(c, tile)
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
                    for g in products:  # V^T by ldmatrix, then the KV tile is released
                        yield ("read", f"kv{g % 4}", g)
                        yield ("arrive", f"kv_empty{g % 4}")
                    for g in products:  # the PV WGMMAs read P until the step's last wait_group
                        yield ("read", f"P{g % 4}", g)
            if blocks <= c:
                if blocks == 0:
                    if c == 0:
                        yield from self.wait_previous_tile(tile)
                    elif self.drop != EMPTY_TILE_STATS:
                        yield self.wait("stats_full0", tile)
                yield from self.publish(c, tile)
            if blocks % 2 == 1:  # the last pair's zero-filled second block
                e = base + blocks
                yield self.wait(f"kv_full{e % 4}", e // 4)
                yield ("arrive", f"kv_empty{e % 4}")
                if c == 1:
                    yield ("arrive", f"p_full{e % 4}")
            # The epilogue.
            if self.drop != EPILOGUE_STATS:
                yield self.wait(f"stats_full{1 - c}", tile)
            yield self.wait(f"stats_full{c}", tile)
            yield ("read", "stats0", tile)
            yield ("read", "stats1", tile)
            if blocks > 0:
                last = base + blocks - 1
                yield ("read", f"max{last % 4}", last)
            if c == 1:
                yield ("arrive", "tile_done")
            pair_base += (blocks + 1) // 2 + self.q_pairs

    def quantize_staged_q(self, c: int, tile: int, staged: int):
        """Consumer c quantises its half of the tile's staged rows (block positions ``staged``, + 1)."""
        yield self.wait("q_empty", tile - 1)
        for g in (staged, staged + 1):
            if self.drop != STAGED_Q_FULL:
                yield self.wait(f"kv_full{g % 4}", g // 4)
            yield ("read", f"kv{g % 4}", ("q", tile))
        yield ("write", f"sQ{c}", tile)
        for g in (staged, staged + 1):
            yield ("arrive", f"kv_empty{g % 4}")
        yield ("arrive", f"p_full{(staged + c) % 4}")
        yield ("arrive", "q_full")
        other = staged + 1 - c
        yield self.wait(f"p_full{other % 4}", other // 4)

    def wait_previous_tile(self, tile: int):
        """Consumer 0: consumer 1 has finished the previous tile."""
        if tile > 0 and self.drop != TILE_DONE:
            yield self.wait("tile_done", tile - 1)

    def publish(self, c: int, tile: int):
        yield ("write", f"stats{c}", tile)
        yield ("arrive", f"stats_full{c}")

    # The scheduler.
    def run(self, rng: random.Random) -> None:
        actors = {
            "producer first blocks": self.producer(0),
            "producer second blocks": self.producer(1),
            "consumer 0": self.consumer(0),
            "consumer 1": self.consumer(1),
        }
        pending = {name: next(program, None) for name, program in actors.items()}
        while any(op is not None for op in pending.values()):
            runnable = [name for name, op in pending.items() if op is not None and self.ready(op)]
            if not runnable:
                raise ProtocolError(f"deadlock: {pending}")
            name = rng.choice(runnable)
            self.execute(name, pending[name])
            pending[name] = next(actors[name], None)

    def ready(self, op) -> bool:
        if op[0] == "wait":
            return self.mbar[op[1]].ready(op[2] % 2)
        return True

    def execute(self, name, op) -> None:
        kind = op[0]
        if kind == "wait":
            bar = self.mbar[op[1]]
            if bar.completed != op[2] + 1:
                raise ProtocolError(f"{name}: waited for phase {op[2]} of {op[1]}, {bar.completed} completed")
        elif kind == "arrive":
            self.mbar[op[1]].arrive()
        elif kind == "write":
            self.data[op[1]] = op[2]
        elif kind == "read":
            if self.data.get(op[1]) != op[2]:
                raise ProtocolError(f"{name}: read {op[1]} expecting {op[2]}, found {self.data.get(op[1])}")


def random_tiles(rng: random.Random) -> list[int]:
    return [rng.choice([0, 0, 1, 2, 3, 4, 5, 7, 8, 9]) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("staged_q", [False, True], ids=["e4m3_q", "staged_bf16_q"])
def test_random_tiles_and_schedules_keep_the_protocol(staged_q):
    """3000 runs: 300 random tile sequences, 10 random schedules each (a violation raises)."""
    rng = random.Random(20261129)
    for _ in range(300):
        tiles = random_tiles(rng)
        for _ in range(10):
            Model(tiles, staged_q=staged_q).run(rng)


EDGE_TILES = [[0], [1], [0, 0, 0, 0], [1, 1, 1, 1], [2, 0, 0, 3], [3, 1, 3, 1], [5, 1, 0, 8], [9, 9, 9]]


@pytest.mark.parametrize("staged_q", [False, True], ids=["e4m3_q", "staged_bf16_q"])
@pytest.mark.parametrize("tiles", EDGE_TILES)
def test_edge_tile_sequences_keep_the_protocol(tiles, staged_q):
    rng = random.Random(7)
    for _ in range(500):
        Model(tiles, staged_q=staged_q).run(rng)


def violations(tiles: list[int], drop: str, runs: int = 2000, staged_q: bool = False) -> int:
    rng = random.Random(1)
    failures = 0
    for _ in range(runs):
        try:
            Model(tiles, drop=drop, staged_q=staged_q).run(rng)
        except ProtocolError:
            failures += 1
    return failures


@pytest.mark.parametrize("tiles", [[3, 1], [4, 1], [4, 0, 3]])
def test_the_model_finds_the_race_without_tile_done(tiles):
    """Without tile_done, consumer 0 can write the next tile's first P while consumer 1's last PV of a
    tile of odd block count still reads that buffer's previous use (released to the producer before
    the WGMMA completes, so the KV ring does not order it), or publish the next tile's statistics
    (after block 0, or at once in a tile without blocks) before consumer 1 has read the previous
    tile's."""
    assert violations(tiles, TILE_DONE) > 0


def test_the_model_finds_the_empty_tile_race():
    """Without its wait for stats_full[0], consumer 1 publishes the statistics of a tile without blocks
    at once, possibly before consumer 0 has read the previous tile's."""
    assert violations([4, 0, 3], EMPTY_TILE_STATS) > 0


@pytest.mark.parametrize("tiles", [[0], [1], [4, 0, 3]])
def test_the_model_finds_an_early_statistics_read(tiles):
    """Without its wait for the other consumer's stats_full, an epilogue reads statistics not yet
    published."""
    assert violations(tiles, EPILOGUE_STATS) > 0


@pytest.mark.parametrize("tiles", [[1, 1], [4, 0, 3], [2, 5]])
def test_the_model_finds_the_staged_q_race_without_kv_full(tiles):
    """Without the slot's kv_full waits, a consumer reads the staged rows before they land (the slot still
    holding an earlier pair's rows, or nothing)."""
    assert violations(tiles, STAGED_Q_FULL, staged_q=True) > 0
