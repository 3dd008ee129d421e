"""KV block manager: one shared pool of fixed-size KV blocks, per-request block tables, and
the prefix cache that lets requests share full blocks of identical token prefixes.

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


class BlockManager:
    """The pool of `n_blocks` blocks and the prefix-cache index over full blocks."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE,
                 enable_prefix_cache: bool = True, n_state_slots: int = 0) -> None:
        """n_state_slots > 0 (a model with linear-attention layers): each request also holds
        one recurrent-state slot from admission to its end, and shares no blocks (its state
        covers its whole sequence, not blocks of it)."""
        if n_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.n_state_slots = n_state_slots
        self._free_slots = list(range(n_state_slots - 1, -1, -1))  # popped lowest first
        self.state_slots: dict[str, int] = {}
        # what a hybrid fork leaves the engine to copy before the next forward: (the forked
        # rid, "block" or "state", src, dst)
        self.pending_copies: list[tuple[str, str, int, int]] = []
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * n_blocks
        self._hash_of: list[int | None] = [None] * n_blocks
        self._by_hash: dict[int, int] = {}
        # Free blocks, oldest first. An OrderedDict is the doubly linked list with O(1) removal
        # from the middle: a cache hit on a free block takes it out wherever it is.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.tables: dict[str, BlockTable] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- queries ---------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (0..1)."""
        return 1.0 - len(self._free) / self.n_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def table(self, rid: str) -> list[int]:
        return self.tables[rid].blocks

    # -- allocation ------------------------------------------------------------------------
    def _take_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._hash_of[b]
        if h is not None:  # reused for new contents: it no longer holds that prefix
            if self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._hash_of[b] = None
        self._ref[b] = 1
        return b

    def _ref_block(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def cached_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) already holding a prefix of tokens. The last prompt token
        is never covered: its logits are needed, so it is always computed, and the block it
        would be written to must be the request's own."""
        if not self.enable_prefix_cache:
            return [], []
        n_full = (len(tokens) - 1) // self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(n_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def allocate_prompt(self, rid: str, tokens: list[int], shared: list[int] | None = None,
                        shared_hashes: list[int] | None = None) -> int | None:
        """Start rid's table: reuse cached (or given `shared`) full blocks of tokens' prefix.
        Returns the number of tokens already computed, or None (nothing changed) when the free
        pool cannot hold the blocks the first computed token needs."""
        if shared is None:
            shared, shared_hashes = self.cached_prefix(tokens)
            self.prefix_queries += len(tokens)
            self.prefix_hits += len(shared) * self.block_size
        assert rid not in self.tables, rid
        if self.n_state_slots and not self._free_slots:
            return None
        # blocks taken from the free list by the hit must not be counted as free below
        n_from_free = sum(1 for b in shared if self._ref[b] == 0)
        if self.n_free - n_from_free < 1:
            return None
        for b in shared:
            self._ref_block(b)
        self.tables[rid] = BlockTable(list(shared), list(shared_hashes or []))
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
        return self.allocate_prompt(rid, [], parent.blocks[:n_share], parent.hashes[:n_share])

    def _fork_state(self, parent_rid: str, rid: str, at: int) -> int | None:
        """A hybrid fork at position `at` (the parent holds exactly `at` positions): rid shares
        the parent's full blocks before it, takes a copy of the partly filled one and of the
        parent's recurrent state (queued in pending_copies). Returns `at`, or None."""
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

    def grow(self, rid: str, n_tokens: int) -> bool:
        """Make rid's table cover n_tokens positions; False (nothing changed) if the pool is
        short."""
        t = self.tables[rid]
        need = self.blocks_for(n_tokens) - len(t.blocks)
        if need <= 0:
            return True
        if need > self.n_free:
            return False
        # the same blocks in ascending order: attention reads a sequence's blocks as one stream
        # when their ids ascend (the KV storage keeps block b + 1 after block b), and blocks
        # freed tail first would otherwise come back descending
        t.blocks.extend(sorted(self._take_free() for _ in range(need)))
        return True

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
            b = t.blocks[i]
            t.hashes.append(h)
            if h not in self._by_hash and self._hash_of[b] is None:
                self._by_hash[h] = b
                self._hash_of[b] = h
            parent = h

    def truncate(self, rid: str, n_tokens: int) -> None:
        """Shrink rid's table to the blocks n_tokens positions need (rejected draft tokens
        wrote past them). Those blocks hold nothing any prefix may reuse, so they go to the
        front of the free list, the first to be taken again. Never touches a hashed block."""
        t = self.tables[rid]
        keep = self.blocks_for(n_tokens)
        assert keep >= len(t.hashes), "a committed block cannot be rolled back"
        while len(t.blocks) > keep:
            b = t.blocks.pop()
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is None:
                    self._free.move_to_end(b, last=False)

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
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their contents, and index them again
        as they commit); the number of cached blocks forgotten."""
        n = len(self._by_hash)
        self._by_hash.clear()
        self._hash_of = [None] * self.n_blocks
        for t in self.tables.values():
            t.hashes.clear()
        return n
