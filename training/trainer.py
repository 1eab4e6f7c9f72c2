"""The drafter training loop: per sequence, one frozen target forward for the context features (and soft
labels), then all sampled anchor blocks in one drafter forward."""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from draft_worker.dflash2_model import DFlash2DraftModel
from draft_worker.draft_checkpoint import save_drafter
from draft_worker.draft_model import DFlashDraftModel
from training.masks import block_visibility, default_gamma, position_weights
from verify_worker.families.llama.model import TargetModel


@dataclass
class TrainSettings:
    anchors_per_sequence: int = 64
    lr: float = 1e-3
    warmup_fraction: float = 0.04
    soft_label_weight: float = 0.5  # KL to the target's distribution, beside the hard labels
    short_block_probability: float = 0.0  # blocks cut to 8 rows, so the drafter also serves block size 8
    selector_loss_weight: float = 1.0  # DFlash 2: the selector's loss, beside the DFlash loss
    selector_soft_weight: float = 0.0  # DFlash 2: weight of the soft (target-distribution) selector loss
    train_only: tuple[str, ...] = ()  # train only parameters whose name contains one of these (empty: all)
    minutes: float | None = None
    steps: int | None = None
    checkpoint_every_s: float = 300.0
    seed: int = 0


@dataclass
class Example:
    """One training sequence: token ids and where the target-generated part starts."""

    ids: torch.Tensor  # [S] int64
    prompt_len: int


class DrafterTrainer:
    def __init__(self, target: TargetModel, drafter: DFlashDraftModel, settings: TrainSettings):
        self.target, self.settings = target.eval().requires_grad_(False), settings
        self.drafter = drafter.requires_grad_(True)
        if settings.train_only:
            for name, param in drafter.named_parameters():
                param.requires_grad_(any(part in name for part in settings.train_only))
        self.trainable = [p for p in drafter.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError(f"no drafter parameter matches train_only {settings.train_only}")
        cfg = drafter.config
        self.block_size = cfg.block_size
        self.weights = position_weights(cfg.block_size, default_gamma(cfg.block_size))  # [B]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step, self.elapsed, self.tokens = 0, 0.0, 0

    # ---------------------------------------------------------------- one sequence
    @torch.no_grad()
    def target_view(self, ids: torch.Tensor):
        """Tapped features [S, taps * hidden] and target log-probabilities [S, vocab] of a sequence."""
        positions = torch.arange(len(ids))[None]
        out = self.target(ids[None], positions, None, None, self.drafter.config.target_layer_ids)
        return out.taps[0], torch.log_softmax(self.target.logits(out.hidden[0]), -1)

    def sample_anchors(self, example: Example) -> torch.Tensor:
        low, high = max(1, example.prompt_len - 1), len(example.ids) - 2
        candidates = torch.arange(low, high + 1)
        pick = torch.randperm(len(candidates), generator=self.generator)[: self.settings.anchors_per_sequence]
        return candidates[pick].sort().values

    def layout(self, example: Example, anchors: torch.Tensor, full_blocks: bool = False):
        """Block ids, positions, labels and loss weights of the rows of all anchor blocks ([A * B] each)."""
        b, s, ids = self.block_size, len(example.ids), example.ids
        offsets = torch.arange(b)
        positions = (anchors[:, None] + offsets).reshape(-1)  # [A*B]
        block_ids = torch.full((len(anchors), b), self.drafter.config.mask_token_id)
        block_ids[:, 0] = ids[anchors]
        label_positions = positions.clamp(max=s - 1)
        labels = torch.where(positions < s, ids[label_positions], -1)  # [A*B]
        lengths = torch.full((len(anchors),), b)
        if b > 8 and self.settings.short_block_probability > 0 and not full_blocks:
            short = torch.rand(len(anchors), generator=self.generator) < self.settings.short_block_probability
            lengths[short] = 8
        live = (offsets[None, :] < lengths[:, None]).reshape(-1)
        weights = self.weights.repeat(len(anchors)) * (labels >= 0) * live
        return block_ids.reshape(-1), positions, labels, weights, lengths

    def sequence_loss(self, example: Example, anchors: torch.Tensor | None = None, full_blocks: bool = False,
                      view: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(loss, logits of the weighted rows, their labels, their block row index, anchors, their hidden).
        view: the sequence's target_view, when the caller already has it."""
        features, target_logp = view if view is not None else self.target_view(example.ids)
        anchors = self.sample_anchors(example) if anchors is None else anchors
        block_ids, positions, labels, weights, lengths = self.layout(example, anchors, full_blocks)
        mask = block_visibility(anchors, len(example.ids), self.block_size, lengths)
        embed = self.target.embed_weight
        hidden = self.drafter.train_hidden(features, embed[block_ids], positions, mask)  # [A*B, hidden]
        rows = weights > 0
        logits = self.drafter.logits(hidden[rows], self.target.lm_head_weight)  # [R, vocab]
        w = weights[rows]
        hard = F.cross_entropy(logits, labels[rows], reduction="none")
        soft_target = target_logp[positions[rows] - 1]  # the target's distribution for each labelled token
        soft = (soft_target.exp() * (soft_target - torch.log_softmax(logits, -1))).sum(-1)
        per_row = hard + self.settings.soft_label_weight * soft
        if isinstance(self.drafter, DFlash2DraftModel):  # the selector learns to pick the gold candidate
            previous = example.ids[positions[rows] - 1]  # teacher forcing: the true token before each row
            settings = self.settings
            soft_share = settings.selector_soft_weight
            pick_gold = self.drafter.selector_loss(hidden[rows], logits, previous, labels[rows]) \
                if soft_share < 1 else 0.0
            match_target = self.drafter.selector_loss(hidden[rows], logits, previous, labels[rows], soft_target) \
                if soft_share > 0 else 0.0
            mixed = (1 - soft_share) * pick_gold + soft_share * match_target
            per_row = per_row + settings.selector_loss_weight * mixed
        loss = (per_row * w).sum() / w.sum()
        row_in_block = torch.arange(self.block_size).repeat(len(anchors))[rows]
        return loss, logits.detach(), labels[rows], row_in_block, anchors, hidden[rows].detach()

    # ---------------------------------------------------------------- the loop
    def learning_rate(self, progress: float) -> float:
        warm = self.settings.warmup_fraction
        if progress < warm:
            return self.settings.lr * max(progress / warm, 0.01)
        return self.settings.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm) / (1 - warm))))

    def progress(self) -> float:
        s = self.settings
        if s.steps is not None:
            return self.step / s.steps
        return self.elapsed / (s.minutes * 60)

    def train(self, examples: list[Example], out_dir: Path | None = None, log=print, validation=None) -> list[float]:
        losses, last_save, drafter = [], time.monotonic(), self.drafter
        drafter.train()
        while self.progress() < 1.0:
            started = time.monotonic()
            example = examples[int(torch.randint(len(examples), (1,), generator=self.generator))]
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate(self.progress())
            loss = self.sequence_loss(example)[0]
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
            self.optimizer.step()
            self.step += 1
            self.tokens += len(example.ids)
            step_time = time.monotonic() - started
            self.elapsed += step_time
            losses.append(loss.item())
            if self.step % 10 == 0:
                done = min(1.0, self.progress())
                bar = "#" * int(done * 20) + "." * (20 - int(done * 20))
                recent = sum(losses[-10:]) / len(losses[-10:])
                log(f"[{bar}] {done:5.1%} step {self.step} loss {recent:.3f} "
                    f"{len(example.ids) / step_time:.0f} tok/s")
            if out_dir is not None and (time.monotonic() - last_save > self.settings.checkpoint_every_s
                                        or self.progress() >= 1.0):
                self.save(out_dir)
                if validation:
                    log(format_accuracy(self.evaluate(validation)))
                last_save = time.monotonic()
                drafter.train()
        drafter.eval()
        return losses

    @torch.no_grad()
    def evaluate(self, examples: list[Example], chunk: int = 128) -> dict:
        """Greedy drafts from every anchor of each example's generated part (whole blocks only).

        Reports the per-position accuracy, the mean acceptance length over all anchors (1 + leading matches),
        and the acceptance length a greedy server would see: walking each sequence as decoding does (the next
        anchor is the token after the accepted ones), tokens per verify step. The walk weights hard stretches
        by the many steps they take, so it is the lower, honest figure.
        """
        self.drafter.eval()
        b = self.block_size
        correct, total, per_anchor = torch.zeros(b), torch.zeros(b), []
        walk_tokens = walk_steps = 0
        for example in examples:
            anchors = torch.arange(example.prompt_len, len(example.ids) - b + 1)  # [A]
            if not len(anchors):
                continue
            leads, view = [], self.target_view(example.ids)  # one target forward for all chunks
            for part in anchors.split(chunk):
                _, logits, labels, rows, _, hidden = self.sequence_loss(example, part, full_blocks=True, view=view)
                hits = (self.greedy_drafts(example, part, logits, hidden) == labels).float()
                correct.index_add_(0, rows, hits)
                total.index_add_(0, rows, torch.ones_like(hits))
                leads.append(hits.view(len(part), b - 1).cumprod(-1).sum(-1).long())
            lead = torch.cat(leads)  # [A] accepted drafts from each anchor
            per_anchor.append(1.0 + lead.float())
            tokens, steps = walk_acceptance(lead.tolist())
            walk_tokens, walk_steps = walk_tokens + tokens, walk_steps + steps
        accuracy = (correct / total.clamp(min=1))[1:]
        return {"per_position_accuracy": [round(float(a), 4) for a in accuracy],
                "acceptance_length_greedy": round(float(torch.cat(per_anchor).mean()), 4) if per_anchor else 0.0,
                "acceptance_length_walk": round(walk_tokens / walk_steps, 4) if walk_steps else 0.0}

    def greedy_drafts(self, example: Example, anchors: torch.Tensor, logits: torch.Tensor,
                      hidden: torch.Tensor) -> torch.Tensor:
        """What the drafter proposes greedily for whole blocks (rows [A * (B-1)]): the argmax, or for DFlash 2
        the selector's walk from each anchor token."""
        if not isinstance(self.drafter, DFlash2DraftModel):
            return logits.argmax(-1)
        a, n = len(anchors), self.block_size - 1
        tokens, _, _ = self.drafter.walk(hidden.view(a, n, -1), logits.view(a, n, -1), example.ids[anchors],
                                         torch.zeros(a), None)
        return tokens.reshape(-1)

    # ---------------------------------------------------------------- checkpoints
    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_drafter(self.drafter, out_dir)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step, "elapsed": self.elapsed,
                    "tokens": self.tokens, "generator": self.generator.get_state()}, out_dir / "trainer_state.pt")

    def resume(self, out_dir: Path) -> bool:
        path = out_dir / "trainer_state.pt"
        if not path.exists():
            return False
        state = torch.load(path, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed, self.tokens = state["step"], state["elapsed"], state["tokens"]
        self.generator.set_state(state["generator"])
        return True


def walk_acceptance(leads: list[int]) -> tuple[int, int]:
    """Tokens and verify steps of greedy decoding over a sequence whose anchor i would get leads[i] drafts
    accepted: each step commits the accepted drafts plus the target's own token."""
    tokens = steps = index = 0
    while index < len(leads):
        gained = leads[index] + 1
        tokens, steps, index = tokens + gained, steps + 1, index + gained
    return tokens, steps


def format_accuracy(report: dict) -> str:
    accuracy = " ".join(f"{a:.2f}" for a in report["per_position_accuracy"])
    return (f"validation: greedy acceptance length {report['acceptance_length_walk']:.2f} as served "
            f"({report['acceptance_length_greedy']:.2f} averaged over anchors); accuracy by position {accuracy}")
