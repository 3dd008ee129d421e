"""KV block manager: one shared pool of fixed-size KV blocks, per-request block tables, and
the prefix cache that lets requests share full blocks of identical token prefixes. A model
whose sliding-window or chunked layers cache in a pool of their own (`n_win_blocks`) has a
second table per request into that pool, whose blocks go back as soon as every later query's
window has left them: such a request holds O(window) blocks of it however long it grows.

Guarantees: a block is either free, or referenced by one or more requests; a freed block whose
contents are hashed stays findable (and reusable) until the pool needs it, least recently freed
first; `n_free` returns to `n_blocks` once every request is freed. Only full blocks are ever
shared, and a request never writes into a shared block (see `allocate_prompt`).
Refuses: nothing silently: an allocation that does not fit returns False and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BLOCK_SIZE = 16  # positions per KV block; the C core's CLB_KV_BLOCK


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block: its tokens and the hash of the block before it (the whole prefix)."""
    return hash((parent, tokens))


@dataclass
class BlockTable:
    """The blocks of one request, in position order, and the hashes of its full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # one per committed full block
    # windowed-pool blocks at the same indices as `blocks` (-1: given back, or never held)
    win: list[int] = field(default_factory=list)
    win_from: int = 0  # every win entry below this one is -1 (where release_window resumes)


class _Pool:
    """One kind of block: reference counts, the free list and the prefix-cache index."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.ref = [0] * n_blocks
        self.hash_of: list[int | None] = [None] * n_blocks
        self.by_hash: dict[int, int] = {}
        # Free blocks, oldest first. An OrderedDict is the doubly linked list with O(1)
        # removal from the middle: a cache hit on a free block takes it out wherever it is.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))

    def take(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.hash_of[b]
        if h is not None:  # reused for new contents: it no longer holds that prefix
            if self.by_hash.get(h) == b:
                del self.by_hash[h]
            self.hash_of[b] = None
        self.ref[b] = 1
        return b

    def hold(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int, first: bool = False) -> None:
        """Drop one reference; a block nobody holds goes to the free list (to its front when
        `first` and it holds no cached prefix: the first to be taken again)."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None
            if first and self.hash_of[b] is None:
                self.free.move_to_end(b, last=False)

    def n_from_free(self, blocks: list[int]) -> int:
        """How many of blocks (ids, -1 for none) a hit would take out of the free list."""
        return sum(1 for b in blocks if b >= 0 and self.ref[b] == 0)

    def index(self, h: int, b: int) -> None:
        if h not in self.by_hash and self.hash_of[b] is None:
            self.by_hash[h] = b
            self.hash_of[b] = h

    def reset(self) -> None:
        self.by_hash.clear()
        self.hash_of = [None] * self.n_blocks


class BlockManager:
    """The pool of `n_blocks` blocks and the prefix-cache index over full blocks."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE,
                 enable_prefix_cache: bool = True, n_state_slots: int = 0,
                 n_win_blocks: int = 0, window: int = 0, chunk: int = 0) -> None:
        """n_state_slots > 0 (a model with linear-attention layers): each request also holds
        one recurrent-state slot from admission to its end, and shares no blocks (its state
        covers its whole sequence, not blocks of it). n_win_blocks > 0: the windowed pool of
        the layers whose query at p sees [p - window + 1, p] (window > 0) or its own chunk
        [p - p % chunk, p] (chunk > 0)."""
        if n_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if n_win_blocks and (n_state_slots or (window <= 0 and chunk <= 0)):
            raise ValueError("a windowed pool needs a window or a chunk, and no state slots")
        self.n_state_slots = n_state_slots
        self._free_slots = list(range(n_state_slots - 1, -1, -1))  # popped lowest first
        self.state_slots: dict[str, int] = {}
        # what a hybrid fork leaves the engine to copy before the next forward: (the forked
        # rid, "block" or "state", src, dst)
        self.pending_copies: list[tuple[str, str, int, int]] = []
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._pool = _Pool(n_blocks)
        self._win = _Pool(n_win_blocks) if n_win_blocks else None
        self.window = window
        self.chunk = chunk
        self.tables: dict[str, BlockTable] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- queries ---------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self._pool.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (0..1)."""
        return 1.0 - len(self._pool.free) / self.n_blocks

    @property
    def n_win_blocks(self) -> int:
        """Blocks of the windowed pool (0: none)."""
        return self._win.n_blocks if self._win else 0

    @property
    def n_win_free(self) -> int:
        return len(self._win.free) if self._win else 0

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def table(self, rid: str) -> list[int]:
        return self.tables[rid].blocks

    def win_table(self, rid: str) -> list[int]:
        """rid's windowed-pool blocks by table index (-1: given back); [] without that pool."""
        return self.tables[rid].win

    def win_held(self, rid: str) -> int:
        """Windowed-pool blocks rid holds now."""
        return sum(1 for b in self.tables[rid].win if b >= 0)

    def win_first(self, n_tokens: int) -> int:
        """The first table index a query at position n_tokens (or later) still reads in the
        windowed layers: the lowest position their windows or chunks let it see, in blocks."""
        p, lo = n_tokens, n_tokens
        if self.window > 0:
            lo = max(0, p - self.window + 1)
        if self.chunk > 0:
            lo = min(lo, p - p % self.chunk)
        return lo // self.block_size

    # -- allocation ------------------------------------------------------------------------
    def _take_free(self) -> int:
        return self._pool.take()

    def cached_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) already holding a prefix of tokens. The last prompt token
        is never covered: its logits are needed, so it is always computed, and the block it
        would be written to must be the request's own. With a windowed pool the prefix also
        needs that pool's blocks its next query's windows reach, still findable (held by some
        request, or free and not yet reused); it is cut until they are."""
        if not self.enable_prefix_cache:
            return [], []
        blocks, hashes = self._cached_full(tokens)
        n = len(blocks)
        while n > 0 and self._win_hit(hashes[:n]) is None:
            n -= 1
        return blocks[:n], hashes[:n]

    def _win_hit(self, hashes: list[int]) -> list[int] | None:
        """The windowed-pool table of a prefix hit of len(hashes) blocks (-1 below what its
        next query reads), or None when a block it needs is gone; [] without that pool."""
        if self._win is None:
            return []
        n = len(hashes)
        first = self.win_first(n * self.block_size)
        win = [-1] * n
        for i in range(first, n):
            b = self._win.by_hash.get(hashes[i])
            if b is None:
                return None
            win[i] = b
        return win

    def _cached_full(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        n_full = (len(tokens) - 1) // self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(n_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            b = self._pool.by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def allocate_prompt(self, rid: str, tokens: list[int], shared: list[int] | None = None,
                        shared_hashes: list[int] | None = None,
                        shared_win: list[int] | None = None) -> int | None:
        """Start rid's table: reuse cached (or given `shared`, with `shared_win` its windowed-
        pool blocks) full blocks of tokens' prefix. Returns the number of tokens already
        computed, or None (nothing changed) when a free pool cannot hold the blocks the first
        computed token needs."""
        if shared is None:
            shared, shared_hashes = self.cached_prefix(tokens)
            shared_win = self._win_hit(shared_hashes)
            self.prefix_queries += len(tokens)
            self.prefix_hits += len(shared) * self.block_size
        assert rid not in self.tables, rid
        if self.n_state_slots and not self._free_slots:
            return None
        if self._win is not None and shared_win is None:
            shared_win = [-1] * len(shared)
        win = list(shared_win or [])
        # blocks taken from the free list by the hit must not be counted as free below
        if self.n_free - self._pool.n_from_free(shared) < 1:
            return None
        if self._win is not None and self.n_win_free - self._win.n_from_free(win) < 1:
            return None
        for b in shared:
            self._pool.hold(b)
        for b in win:
            if b >= 0:
                assert self._win is not None
                self._win.hold(b)
        self.tables[rid] = BlockTable(list(shared), list(shared_hashes or []), win)
        if self.n_state_slots:
            self.state_slots[rid] = self._free_slots.pop()
        return len(shared) * self.block_size

    def fork(self, parent_rid: str, rid: str, n_prompt: int) -> int | None:
        """rid shares parent's full blocks before its last prompt token (n choices of one
        prompt share one prefill). Returns the tokens rid need not compute, or None. With
        state slots the parent must hold exactly n_prompt - 1 positions (Scheduler holds its
        prefill there): see _fork_state."""
        parent = self.tables[parent_rid]
        if self.n_state_slots:
            return self._fork_state(parent_rid, rid, n_prompt - 1)
        n_share = min(len(parent.blocks), (n_prompt - 1) // self.block_size)
        if self._win is None:
            return self.allocate_prompt(rid, [], parent.blocks[:n_share],
                                        parent.hashes[:n_share])
        # the windowed blocks rid's first query reads must still be the parent's: the parent
        # may have decoded past them and given them back, and then rid shares less
        while n_share > 0 and -1 in parent.win[self.win_first(n_share * self.block_size):
                                               n_share]:
            n_share -= 1
        first = self.win_first(n_share * self.block_size)
        win = [-1] * first + parent.win[first:n_share]
        return self.allocate_prompt(rid, [], parent.blocks[:n_share], parent.hashes[:n_share],
                                    win)

    def _fork_state(self, parent_rid: str, rid: str, at: int) -> int | None:
        """A hybrid fork at position `at` (the parent holds exactly `at` positions): rid shares
        the parent's full blocks before it, takes a copy of the partly filled one and of the
        parent's recurrent state (queued in pending_copies). Returns `at`, or None."""
        assert self._win is None, "a hybrid model has no windowed pool"
        parent = self.tables[parent_rid]
        n_share = at // self.block_size
        partial = at % self.block_size != 0
        if self.allocate_prompt(rid, [], parent.blocks[:n_share], []) is None:
            return None
        if partial:
            dst = self._take_free()
            self.tables[rid].blocks.append(dst)
            self.pending_copies.append((rid, "block", parent.blocks[n_share], dst))
        self.pending_copies.append((rid, "state", self.state_slots[parent_rid],
                                    self.state_slots[rid]))
        return at

    def state_slot(self, rid: str) -> int:
        """rid's recurrent-state slot (models with linear-attention layers)."""
        return self.state_slots[rid]

    def fits(self, rid: str, n_tokens: int, reserve: int = 0) -> bool:
        """Whether grow(rid, n_tokens) would succeed leaving `reserve` blocks free in each
        pool."""
        need = self.blocks_for(n_tokens) - len(self.tables[rid].blocks)
        return need <= 0 or (need <= self.n_free - reserve and (
            self._win is None or need <= self.n_win_free - reserve))

    def grow(self, rid: str, n_tokens: int) -> bool:
        """Make rid's table cover n_tokens positions (in both pools: every new position is
        written); False (nothing changed) if a pool is short."""
        t = self.tables[rid]
        need = self.blocks_for(n_tokens) - len(t.blocks)
        if need <= 0:
            return True
        if not self.fits(rid, n_tokens):
            return False
        # the same blocks in ascending order: attention reads a sequence's blocks as one stream
        # when their ids ascend (the KV storage keeps block b + 1 after block b), and blocks
        # freed tail first would otherwise come back descending
        t.blocks.extend(sorted(self._pool.take() for _ in range(need)))
        if self._win is not None:
            t.win.extend(sorted(self._win.take() for _ in range(need)))
        return True

    def release_window(self, rid: str, n_computed: int) -> int:
        """Give back rid's windowed-pool blocks that no query at position n_computed or later
        reads (rid has computed n_computed positions; they never go back below that). Those
        that hold an indexed prefix stay findable until reused. Returns how many went."""
        if self._win is None:
            return 0
        t = self.tables[rid]
        n = 0
        end = min(self.win_first(n_computed), len(t.win))
        for i in range(t.win_from, end):
            if t.win[i] >= 0:
                self._win.release(t.win[i], first=True)
                t.win[i] = -1
                n += 1
        t.win_from = max(t.win_from, end)
        return n

    def commit(self, rid: str, tokens: list[int], n_computed: int) -> None:
        """Index rid's full blocks among its first n_computed tokens in the prefix cache."""
        if not self.enable_prefix_cache:
            return
        t = self.tables[rid]
        n_full = min(n_computed // self.block_size, len(t.blocks))
        parent = t.hashes[-1] if t.hashes else None
        for i in range(len(t.hashes), n_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            t.hashes.append(h)
            self._pool.index(h, t.blocks[i])
            if self._win is not None and t.win[i] >= 0:
                self._win.index(h, t.win[i])
            parent = h

    def truncate(self, rid: str, n_tokens: int) -> None:
        """Shrink rid's table to the blocks n_tokens positions need (rejected draft tokens
        wrote past them). Those blocks hold nothing any prefix may reuse, so they go to the
        front of the free list, the first to be taken again. Never touches a hashed block."""
        t = self.tables[rid]
        keep = self.blocks_for(n_tokens)
        assert keep >= len(t.hashes), "a committed block cannot be rolled back"
        while len(t.blocks) > keep:
            self._pool.release(t.blocks.pop(), first=True)
            if self._win is not None:
                b = t.win.pop()
                if b >= 0:
                    self._win.release(b, first=True)

    def free(self, rid: str) -> None:
        """Return rid's blocks; hashed ones stay findable until reused. Unknown rid: no-op."""
        t = self.tables.pop(rid, None)
        if t is None:
            return
        slot = self.state_slots.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)
            self.pending_copies = [c for c in self.pending_copies if c[0] != rid]
        # the tail first, so that when the pool runs short a prefix's last block goes before
        # its first (which other prompts are more likely to share)
        for b in reversed(t.blocks):
            self._pool.release(b)
        if self._win is not None:
            for b in reversed(t.win):
                if b >= 0:
                    self._win.release(b)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their contents, and index them again
        as they commit); the number of cached full-layer blocks forgotten."""
        n = len(self._pool.by_hash)
        self._pool.reset()
        if self._win is not None:
            self._win.reset()
        for t in self.tables.values():
            t.hashes.clear()
        return n
