"""Block manager: property tests (hypothesis state machine) over a simulated pool, plus memory figures."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hfaccel.kv import BlockManager, CacheFullError, DeviceBlockTables
from hfaccel.kv import device_tables as device_tables_module

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A small alphabet and shared stems make identical prompt prefixes (prefix hits) common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
SPANS = st.tuples(st.integers(0, 8), st.integers(1, 10)).map(lambda s: (s[0], s[0] + s[1]))  # (start, end)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager with random operations while simulating the device pool it describes.

    The simulated pool stores, per slot, the token written there. Writes go only where the manager says a
    sequence's tokens live, copies are applied as returned, so if the manager ever shares a block wrongly,
    reuses a live block, or returns a prefix hit holding other tokens, some live sequence's slots stop
    holding its own tokens — which the invariant checks after every step. A ``DeviceBlockTables`` of two rows
    (so that rows are reused and the table grows) follows the manager's tables by incremental uploads.
    """

    def __init__(self):
        super().__init__()
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # what each live sequence holds
        self.pool: dict[int, int] = {}  # slot -> token written there
        self.uncomputed: dict[int, int] = {}  # sequence -> first token whose K/V is not written yet
        self.probed = None  # (tokens, the prefix hit found for them) of an earlier probe

    @initialize(prefix_caching=st.booleans())
    def setup(self, prefix_caching):
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        self.device_tables = DeviceBlockTables(self.manager, NUM_BLOCKS, torch.device("cpu"), rows=2)

    def _write(self, seq_id, start, tokens):
        slots = self.manager.slots(seq_id, start, start + len(tokens))
        for slot, token in zip(slots, tokens):
            block = slot // BLOCK_SIZE
            assert self.manager.ref_counts[block] == 1, f"write into block {block} shared by several sequences"
            self.pool[slot] = token

    def _copy(self, copies):
        for copy in copies:
            for offset in range(BLOCK_SIZE):
                src = copy.src * BLOCK_SIZE + offset
                if src in self.pool:
                    self.pool[copy.dst * BLOCK_SIZE + offset] = self.pool[src]

    def _state(self) -> tuple:
        """The free pool in its order, the prefix cache's registrations and the ref-counts."""
        manager = self.manager
        return list(manager._free), dict(manager.prefix_cache._blocks), list(manager.ref_counts)

    def _computed(self):
        return sorted(s for s in self.tokens if s not in self.uncomputed)

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(1, 9), max_size=9),
        computed=st.booleans(),
        unsplit=st.lists(SPANS, max_size=3).map(tuple),
    )
    def add(self, stem, tail, computed, unsplit):
        """computed=False: the engine's way, K/V written later (``compute``); no hit may reach them before. The
        hit ``prefix_hit`` finds first is the one taken, with the free blocks it says, and finding it changes
        nothing; handed to ``add_sequence`` (the engine's way) or not."""
        tokens = stem + tail
        before = self._state()
        hit = self.manager.prefix_hit(tokens, unsplit=unsplit)
        assert self._state() == before
        self._add(tokens, computed, unsplit, hit, hand_over=bool(len(tail) % 2))

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(1, 9), max_size=9))
    def probe(self, stem, tail):
        """A prompt's prefix hit, found now and handed to ``add_sequence`` later (``add_probed``)."""
        self.probed = (stem + tail, self.manager.prefix_hit(stem + tail))

    @precondition(lambda self: self.probed is not None)
    @rule()
    def add_probed(self):
        """An earlier probe's hit handed to ``add_sequence`` after other changes: taken where its blocks still hold
        their keys, else found again — never a block that now holds other tokens (the slots are checked)."""
        tokens, hit = self.probed
        self.probed = None
        self._add(tokens, True, (), self.manager.prefix_hit(tokens), hand_over=True, given=hit)

    def _add(self, tokens, computed, unsplit, hit, hand_over, given=None):
        """Add ``tokens`` as a new sequence, ``hit`` what a probe finds now (``given``, or it, handed over)."""
        seq_id = self.next_id
        free_before = self.manager.num_free_blocks
        found = (given or hit) if hand_over else None
        kept = given is not None and self.manager.prefix_cache.registered(given.blocks, given.hashes)
        try:
            cached = self.manager.add_sequence(seq_id, tokens, computed=computed, unsplit=unsplit, hit=found)
        except CacheFullError:
            assert self.manager.num_free_blocks == free_before and seq_id not in self.manager
            assert kept or hit.free_blocks > free_before
            return
        if kept:  # a shorter hit than a probe finds now, where blocks were registered since
            assert cached == given.tokens <= hit.tokens
        else:
            assert (cached, free_before - self.manager.num_free_blocks) == (hit.tokens, hit.free_blocks)
        assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
        assert not any(start < cached < end for start, end in unsplit)
        for slot, token in zip(self.manager.slots(seq_id, 0, cached), tokens):
            assert self.pool.get(slot) == token, "prefix hit returned a block holding other tokens"
        if computed:
            self._write(seq_id, cached, tokens[cached:])
        else:
            self.uncomputed[seq_id] = cached
        self.tokens[seq_id] = tokens
        self.next_id += 1

    @precondition(lambda self: self.uncomputed)
    @rule(data=st.data())
    def compute(self, data):
        """A prefill chunk of a sequence added with computed=False runs: its K/V are written."""
        seq_id = data.draw(st.sampled_from(sorted(self.uncomputed)))
        start, tokens = self.uncomputed[seq_id], self.tokens[seq_id]
        end = data.draw(st.integers(start + 1, len(tokens)))
        self._write(seq_id, start, tokens[start:end])
        self.manager.mark_computed(seq_id, end)
        if end == len(tokens):
            del self.uncomputed[seq_id]
        else:
            self.uncomputed[seq_id] = end

    @precondition(lambda self: any(s not in self.uncomputed for s in self.tokens))
    @rule(data=st.data(), count=st.integers(0, 3))
    def append_to_several(self, data, count):
        """The exact block count of appending to several sequences at once (beam rows after a reorder)."""
        ids = data.draw(st.lists(st.sampled_from(self._computed()), min_size=1, max_size=4, unique=True))
        predicted, free_before = self.manager.blocks_to_append_many(ids, count), self.manager.num_free_blocks
        if predicted > free_before:
            return
        for seq_id in ids:
            new = [7] * count
            self._copy(self.manager.append(seq_id, count, new))
            self._write(seq_id, len(self.tokens[seq_id]), new)
            self.tokens[seq_id] = self.tokens[seq_id] + new
        assert free_before - self.manager.num_free_blocks == predicted

    @precondition(lambda self: any(s not in self.uncomputed for s in self.tokens))
    @rule(data=st.data(), new=st.lists(st.integers(1, 9), min_size=1, max_size=6))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(self._computed()))
        try:
            copies = self.manager.append(seq_id, len(new), new)
        except CacheFullError:
            return
        self._copy(copies)
        self._write(seq_id, len(self.tokens[seq_id]), new)
        self.tokens[seq_id] = self.tokens[seq_id] + new

    @precondition(lambda self: any(s not in self.uncomputed for s in self.tokens))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._computed()))
        self.manager.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: any(s not in self.uncomputed for s in self.tokens))
    @rule(data=st.data())
    def crop(self, data):
        seq_id = data.draw(st.sampled_from(self._computed()))
        length = data.draw(st.integers(0, len(self.tokens[seq_id])))
        self.manager.crop(seq_id, length)
        self.tokens[seq_id] = self.tokens[seq_id][:length]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id]
        self.uncomputed.pop(seq_id, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def upload(self, data):
        """A decode step's upload of some sequences: their device rows hold their tables afterwards."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True))
        lengths = [len(self.tokens[seq_id]) for seq_id in ids]
        rows, ends = self.device_tables.upload(ids, lengths, [lengths], len(ids) + 1)
        assert ends.tolist() == lengths + [0]
        for seq_id, row in zip(ids, rows.tolist()):
            blocks = self.manager.block_table(seq_id)
            assert self.device_tables.table[row, : len(blocks)].tolist() == blocks, f"row of sequence {seq_id}"
        assert len(set(rows[: len(ids)].tolist())) == len(ids), "two sequences share a row"

    @invariant()
    def consistent(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()  # no leak, no double free, ref-counts match the tables
        for seq_id, tokens in self.tokens.items():
            assert self.manager.seq_len(seq_id) == len(tokens)
            written = self.uncomputed.get(seq_id, len(tokens))
            tokens = tokens[:written]
            held = [self.pool.get(slot) for slot in self.manager.slots(seq_id, 0, written)]
            assert held == tokens, f"sequence {seq_id} lost its tokens: holds {held}, expected {tokens}"

    def teardown(self):
        if hasattr(self, "manager"):
            self.manager.reset()
            assert self.manager.num_free_blocks == NUM_BLOCKS, "blocks leaked"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_device_tables_send_only_what_changed(monkeypatch):
    """An append-only step sends only the new blocks; a copy-on-write or a crop, the sequence's whole table; a
    sequence id used again after being freed gets its new table; a step longer than a sequence holds is refused."""
    sent = []
    monkeypatch.setattr(
        device_tables_module,
        "to_device",
        lambda values, *args: sent.append(len(values)) or torch.tensor(values, dtype=torch.int64),
    )
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    tables = DeviceBlockTables(manager, 8, torch.device("cpu"), rows=1)

    def step(*seq_ids) -> list[int]:
        ends = [manager.seq_len(s) for s in seq_ids]
        rows, _ = tables.upload(seq_ids, ends, [ends], len(seq_ids))
        for seq_id, row in zip(seq_ids, rows.tolist()):
            assert tables.table[row, : len(manager.block_table(seq_id))].tolist() == manager.block_table(seq_id)
        return sent[-1] - 2 * len(seq_ids)  # values of block updates sent: 3 per block

    manager.add_sequence("a", num_tokens=9)  # 3 blocks
    assert step("a") == 9
    assert step("a") == 0
    manager.append("a", 3)  # 12 tokens, still 3 blocks
    assert step("a") == 0
    manager.append("a", 1)  # a 4th block
    assert step("a") == 3
    manager.fork("a", "b")  # b: a new sequence (a new row: the table grows), its whole table
    assert step("a", "b") == 12
    manager.append("b", 1)  # b writes into a shared last block: copy-on-write, then b's whole table
    assert step("a", "b") == 12
    manager.crop("a", 5)  # frees 2 blocks: a's whole table, 2 blocks
    assert step("a", "b") == 6
    manager.free("a")
    manager.add_sequence("a", num_tokens=2)
    assert step("a") == 3
    with pytest.raises(ValueError, match="holds 2 slots; a step needs 3"):
        tables.upload(["a"], [3], [], 1)


def test_full_pool_raises_and_changes_nothing():
    manager = BlockManager(4, 16)
    manager.add_sequence("a", num_tokens=40)
    with pytest.raises(CacheFullError, match="needs 2 free blocks"):
        manager.add_sequence("b", num_tokens=20)
    assert "b" not in manager and manager.num_free_blocks == 1
    with pytest.raises(CacheFullError):
        manager.append("a", 30)
    assert manager.seq_len("a") == 40 and manager.num_free_blocks == 1
    manager.append("a", 8)  # still usable
    manager.check_invariants()


def test_fork_copies_on_write_only_the_partial_last_block():
    manager = BlockManager(8, 4)
    manager.add_sequence("parent", num_tokens=6)  # blocks: one full, one partial
    manager.fork("parent", "child")
    full, partial = manager.block_table("parent")
    copies = manager.append("child", 1)
    assert [(c.src, c.dst) for c in copies] == [(partial, manager.block_table("child")[1])]
    assert manager.block_table("child")[0] == full and manager.ref_counts[full] == 2
    assert manager.append("parent", 1) == []  # parent now holds its partial block alone


def test_a_probed_hit_is_taken_as_found_while_its_blocks_keep_their_keys():
    """The scheduler probes a prompt's hit, then admits it with that hit: no second lookup while the hit's blocks are
    registered under their keys; a hit whose blocks were reused since is found again (here: nothing)."""
    manager = BlockManager(4, 4, enable_prefix_caching=True)
    prompt = list(range(1, 10))
    manager.add_sequence("a", prompt)
    hit = manager.prefix_hit(prompt)
    assert hit.tokens == 8 and len(hit.blocks) == len(hit.hashes) == 2
    lookups = []
    original = manager.prefix_cache.hits
    manager.prefix_cache.hits = lambda *args: lookups.append(args) or original(*args)
    assert manager.add_sequence("b", prompt, hit=hit) == 8 and not lookups
    manager.free("a")
    manager.free("b")
    manager.add_sequence("c", [7] * 16)  # every block reused for other tokens
    manager.free("c")
    assert manager.add_sequence("d", prompt, hit=hit) == 0 and len(lookups) == 2  # "c"'s, then "d"'s
    manager.check_invariants()


def test_common_system_prompt_is_allocated_once():
    """N requests sharing a 1000-token system prompt hold its full blocks once."""
    manager = BlockManager(2000, 16)
    system = list(range(1000))
    for request in range(10):
        manager.add_sequence(request, system + [5000 + request] * 30)
    shared_blocks = 1000 // 16
    assert manager.num_used_blocks == shared_blocks + 10 * (manager.blocks_needed(1030) - shared_blocks)
    for request in range(1, 10):
        assert manager.block_table(request)[:shared_blocks] == manager.block_table(0)[:shared_blocks]


def test_waste_under_four_percent_for_400_to_4000_tokens():
    import random

    rng = random.Random(0)
    manager = BlockManager(20000, 16, enable_prefix_caching=False)
    lengths = [rng.randint(400, 4000) for _ in range(64)]
    for seq_id, length in enumerate(lengths):
        manager.add_sequence(seq_id, num_tokens=length - 10)
        manager.append(seq_id, 10)
    allocated = manager.num_used_blocks * 16
    waste = (allocated - sum(lengths)) / allocated
    assert manager.num_tokens() == sum(lengths)
    assert waste < 0.04, waste


def test_a_cropped_sequence_never_rewrites_a_registered_block():
    """Regression (found by the state machine): crop into a registered block that another sequence shares,
    let the sharers go, append — the write must not change what the block's hash promises."""
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    manager.add_sequence("a", tokens, computed=False)
    manager.mark_computed("a", 8)  # registers both blocks
    assert manager.add_sequence("b", tokens) == 4  # shares the first block
    shared = manager.block_table("a")[0]
    manager.crop("a", 1)  # "a" now ends inside the shared, registered block
    manager.fork("a", "fork")
    manager.free("fork")
    manager.free("b")  # "a" holds the registered block alone
    assert manager.append("a", 1, [1]) == []  # writes position 1 of that block: [1, 1, 3, 4]
    assert manager.block_table("a")[0] == shared
    manager.check_invariants()
    assert manager.add_sequence("c", tokens) == 0  # no hit on a block whose content changed
    assert manager.block_table("c")[0] != shared


def test_a_cropped_sequence_copies_a_registered_block_it_shares():
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    manager.add_sequence("a", tokens)
    manager.add_sequence("b", tokens)
    shared = manager.block_table("a")[0]
    manager.crop("a", 2)
    copies = manager.append("a", 1, [9])
    assert [(c.src, c.dst) for c in copies] == [(shared, manager.block_table("a")[0])]
    assert manager.add_sequence("c", tokens) == 4 and manager.block_table("c")[0] == shared  # still cached
    manager.check_invariants()


def test_a_hit_ending_inside_an_unsplit_span_is_cut_back_before_it():
    """``unsplit=((start, end), ...)``: a hit that would end inside one of those spans is cut back to the block
    boundary at or before its start (and again if that falls inside another); a hit ending before a span's start or
    at its end and past it is taken whole. The blocks not taken are allocated, registered next to the cached ones,
    and nothing is held twice."""
    manager = BlockManager(24, 4)
    prompt = list(range(14))
    manager.add_sequence("a", prompt)  # three full blocks cached: a hit covers 12 tokens
    assert manager.add_sequence("b", prompt, unsplit=((5, 12),)) == 12  # ends at the span's end
    assert manager.add_sequence("c", prompt, unsplit=((6, 13),)) == 4  # would end inside: cut to the boundary at 4
    assert manager.add_sequence("d", prompt, unsplit=((0, 14),)) == 0
    assert manager.add_sequence("e", prompt, unsplit=((12, 14),)) == 12  # ends before the span
    assert manager.add_sequence("f", prompt, unsplit=((2, 6), (9, 13))) == 8  # cut before the second span only
    assert manager.add_sequence("g", prompt, unsplit=((2, 9), (9, 13))) == 0  # cut to 8, inside the first: to 0
    assert manager.num_free_blocks == 24 - 4 - 1 - 3 - 4 - 1 - 2 - 4
    manager.check_invariants()
    for seq_id in ("a", "b", "c", "d", "e", "f", "g"):
        manager.free(seq_id)
    assert manager.add_sequence("h", prompt) == 12


def test_salts_from_key_the_blocks_from_their_tokens_on():
    """``salts_from=((token, salt), ...)``: the blocks before the one holding ``token`` are shared with any prompt of
    those tokens; that block and those after it only with prompts under the same salt from the same block (a
    prompt's images: the text before them is shared, not what follows)."""
    manager = BlockManager(48, 4)
    prompt = list(range(18))
    manager.add_sequence("images-1", prompt, salts_from=((9, "image 1"),))
    assert manager.add_sequence("images-2", prompt, salts_from=((9, "image 2"),)) == 8  # the blocks before token 9
    assert manager.add_sequence("text", prompt) == 8
    assert manager.add_sequence("images-1 again", prompt, salts_from=((10, "image 1"),)) == 16  # the same block
    assert manager.add_sequence("images-1 earlier", prompt, salts_from=((7, "image 1"),)) == 4
    manager.fork("images-1", "fork")
    manager.append("fork", 3, [18, 19, 20])
    assert manager.add_sequence("longer", [*prompt, 18, 19, 20, 21], salts_from=((9, "image 1"),)) == 20
    manager.check_invariants()


def test_each_salt_keys_the_blocks_from_its_own_token_on():
    """A prompt of two images (salts at their first tokens) shares the blocks up to its second image's with a prompt
    whose first image is the same and whose second differs, and none from its first image's on with one whose first
    image differs; two salts in one block key it by both."""
    manager = BlockManager(48, 4)
    prompt = list(range(18))
    manager.add_sequence("a, b", prompt, salts_from=((5, "a"), (13, "b")))
    assert manager.add_sequence("a, c", prompt, salts_from=((5, "a"), (13, "c"))) == 12
    assert manager.add_sequence("c, b", prompt, salts_from=((5, "c"), (13, "b"))) == 4
    assert manager.add_sequence("a, b again", prompt, salts_from=((5, "a"), (13, "b"))) == 16
    other = list(range(100, 118))
    manager.add_sequence("a, b in a block", other, salts_from=((5, "a"), (6, "b")))
    assert manager.add_sequence("a alone in it", other, salts_from=((5, "a"),)) == 4
    assert manager.add_sequence("b alone in it", other, salts_from=((6, "b"),)) == 4
    assert manager.add_sequence("both again", other, salts_from=((5, "a"), (6, "b"))) == 16
    manager.check_invariants()
    manager.check_invariants()
