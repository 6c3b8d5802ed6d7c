"""The prefix cache of continuous batching (engine.batch): which tokens each slot of the batch's
cache holds from position 0, which slot a new sequence takes, and what is copied into it, so
that a sequence prefills only what no slot holds yet.

On where the slot cache holds nothing but per-position entries (no per_sequence() state; not
Qwen3.5, whose DeltaNet state sums every token read). A free slot keeps what its last sequence
wrote (its prompt and every output token but the last, never fed) until it is taken again. A
new sequence takes
    - the free slot whose tokens it continues (its chat's next turn: all but fewer than
      PREFIX_COPY_MIN of the tokens the slot holds begin the new prompt), reading the rest;
    - else the least recently freed slot, into which the longest prefix any slot holds (free
      or decoding: a shared system prompt, an agent's tool list) is copied first when it is
      PREFIX_COPY_MIN tokens or more;
and where its prompt shares PREFIX_COPY_MIN tokens more with a sequence still reading its own
(requests arriving together with one system prompt, the n choices of one request), it waits
for that one to have read them, then copies them (not with MTP drafts).
At least the prompt's last token is always read (its logits give the first new token). With MTP
drafts, a slot's tokens count only as far as the MTP layer has read them, less one position.
The memory is the slots' own: nothing is allocated for the cache; a sequence that needs a slot
evicts the least recently freed one.
"""
from __future__ import annotations

PREFIX_COPY_MIN = 16   # the shortest prefix copied from another slot (a chat template's first tokens are fewer)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b share (list slices compare in C: a bisection of them)."""
    n = min(len(a), len(b))
    if not n or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n   # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def written(seq, mtp: bool) -> list[int]:
    """The tokens whose cache entries an engine.batch.Sequence's slot holds now, from position 0:
    the prompt read so far, then every output token but the last (not fed yet); with MTP drafts
    only as far as the MTP layer has read them too."""
    tokens = seq.prompt + seq.out.out_ids[:-1] if seq.decoding else seq.prompt[:seq.prefilled]
    return tokens[:seq.mtp_done] if mtp else tokens


class SlotPrefixes:
    """The free slots of a batch (least recently freed first) and the tokens each holds; the
    batch's active sequences are read through the list it keeps (active)."""

    def __init__(self, cache, enabled: bool, mtp: bool, active: list):
        self.cache, self.mtp, self.active = cache, mtp, active
        self.enabled = enabled and not cache.per_sequence()
        self.free = list(range(cache.slots))
        self.held: list[list[int]] = [[] for _ in range(cache.slots)]   # a free slot's tokens, from position 0
        self.cached_tokens = 0                                         # prompt tokens found, all sequences

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for prompt (one must be free) and how many of its first tokens it holds now."""
        if not self.enabled:
            return self.free.pop(0), 0
        best, src = 0, None
        for slot in self.free:
            n = common_prefix(self.held[slot], prompt)
            if n > best:
                best, src = n, slot
        for seq in self.active:
            n = common_prefix(written(seq, self.mtp), prompt)
            if n > best:
                best, src = n, seq.slot
        # an MTP entry at position i read token i+1 too: with drafts, one position less is sure
        reuse = min(best - self.mtp, len(prompt) - 1)
        # the slot it continues, or the one to be evicted anyway: taken as it is
        if src in self.free and reuse > 0 and (src == self.free[0] or len(self.held[src]) - best < PREFIX_COPY_MIN):
            self.free.remove(src)
            self.cached_tokens += reuse
            return src, reuse
        slot = self.free.pop(0)
        if reuse < PREFIX_COPY_MIN:
            return slot, 0
        self._copy(src, slot, 0, reuse)
        return slot, reuse

    def source(self, prompt: list[int], have: int):
        """(a sequence still reading a prompt that shares PREFIX_COPY_MIN tokens more than have
        with this one, how many): the new sequence waits for it; or (None, 0)."""
        if not self.enabled or self.mtp:
            return None, 0
        best, src = 0, None
        for seq in self.active:
            if not seq.decoding and seq.waits is None:
                n = min(common_prefix(seq.prompt, prompt), len(prompt) - 1)
                if n > best:
                    best, src = n, seq
        return (src, best) if src is not None and best - have >= PREFIX_COPY_MIN else (None, 0)

    def resolve(self, seq) -> None:
        """A waiting sequence whose source has read what it waits for (or has ended): the shared
        tokens copied into its slot; it reads the rest from the next step on."""
        src = seq.waits
        if src in self.active and not src.decoding and src.prefilled < seq.waits_for:
            return
        tokens = written(src, self.mtp) if src in self.active else self.held[src.slot] if src.slot in self.free else []
        reuse = min(common_prefix(tokens, seq.prompt), len(seq.prompt) - 1)
        seq.waits, seq.waits_for = None, 0
        if reuse > seq.prefilled:
            self._copy(src.slot, seq.slot, seq.prefilled, reuse)
            seq.prefilled = seq.cached = seq.mtp_done = reuse

    def release(self, seq, keep: bool = True) -> None:
        """An ended sequence's slot is free; it holds what the sequence wrote (nothing unless keep)."""
        self.held[seq.slot] = written(seq, self.mtp) if self.enabled and keep else []
        self.free.append(seq.slot)

    def _copy(self, src: int, dst: int, start: int, stop: int) -> None:
        """Positions start..stop-1 of slot src into slot dst."""
        for t in self.cache.per_position():     # [layers, slots, S, ...]
            t[:, dst, start:stop].copy_(t[:, src, start:stop])
        self.cached_tokens += stop - start
