"""Drafts from a small model that shares the target's tokenizer (e.g. qwen2.5-coder-0.5b
for qwen2.5-coder-1.5b), with its own weights, paged KV and block pool.

Each target sequence has a shadow sequence in the draft model. Before drafting, the
shadow is brought in step with the target: its tokens after the first one the target
did not accept are replaced by the target's, and its KV progress rolled back to there
(later slots are simply overwritten). Then it decodes up to k tokens, one pass each.

A sampled request's draft is drawn with the sampler's noise for the same position (the
noise of a seeded request depends only on seed, choice and position), so the draft and
the target sample with shared randomness: whenever the two distributions are close
they pick the same token, and the verification stays exact whatever the draft does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kamado.config import EngineConfig
from kamado.engine.model_loading import load_for_engine
from kamado.engine.model_runner import ModelRunner
from kamado.engine.scheduler import ScheduledSeq
from kamado.engine.sequence import Sequence
from kamado.kv.block_pool import BlockPool


@dataclass
class _Shadow:
    seq: Sequence  # the draft model's copy: its own tokens, KV progress and blocks
    synced: int  # its tokens before this index are known to be the target's


class DraftModelProposer:
    name = "draft"

    def __init__(self, config: EngineConfig, draft_model: str, target_vocab_size: int) -> None:
        draft_config = replace(
            config,
            model=draft_model,
            speculation="off",
            cuda_graphs=False,
            enable_prefix_caching=False,
        )
        loaded = load_for_engine(draft_config)
        if loaded.model_config.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model {draft_model!r} has a vocabulary of "
                f"{loaded.model_config.vocab_size} tokens, the target {target_vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.block_size = config.block_size
        self.runner = ModelRunner(
            draft_config,
            loaded.model_config,
            loaded.model,
            loaded.dtype,
            loaded.num_blocks,
            loaded.kv_format,
        )
        self.pool = BlockPool(loaded.num_blocks)
        self._shadows: dict[Sequence, _Shadow] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        shadow = self._shadow_of(seq)
        draft: list[int] = []
        while len(draft) < k:
            s = shadow.seq
            num_new = s.num_uncomputed
            if not self.pool.grow(s.block_table, s.num_computed + num_new, self.block_size):
                break  # the draft model's KV is full: fewer drafts this step
            (verified,) = self.runner.execute([ScheduledSeq(s, num_new)])
            s.num_computed += num_new
            token = verified.token_ids[0]
            s.token_ids.append(token)
            draft.append(token)
        return draft

    def _shadow_of(self, seq: Sequence) -> _Shadow:
        shadow = self._shadows.get(seq)
        if shadow is None:
            copy = Sequence(
                seq.request_id, seq.index, seq.prompt_token_ids, seq.params, seq.arrival
            )
            copy.token_ids = list(seq.token_ids)
            shadow = self._shadows[seq] = _Shadow(copy, len(seq.token_ids))
            return shadow
        s, target = shadow.seq, seq.token_ids
        same = shadow.synced
        while same < min(len(s.token_ids), len(target)) and s.token_ids[same] == target[same]:
            same += 1
        del s.token_ids[same:]
        s.token_ids.extend(target[same:])
        # At least the last token is computed again: its logits give the next draft.
        s.num_computed = min(s.num_computed, same, len(s.token_ids) - 1)
        self.pool.shrink(s.block_table, s.num_computed, self.block_size)
        shadow.synced = len(target)
        return shadow

    def finish(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.pool.shrink(shadow.seq.block_table, 0, self.block_size)
