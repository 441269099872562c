"""K3ForConditionalGeneration: the MoonViT-V2 tower and projector (model/vision.py) feeding the text model
(spec/vision.md §8, the release's `KimiK3ForConditionalGeneration`).

Image rows enter the text stream at the media placeholder id (`config.media_placeholder_token_id`). Two prompt
conventions are in use and both are accepted, per image:
- one placeholder per image (the released HF code): it is expanded to the image's N rows, the sequence grows;
- N consecutive placeholders per image (vLLM, SGLang): they are replaced in place.
Images are matched to placeholders in reading order over the flattened batch. Rows of different grown lengths are
aligned as the release aligns them: right-aligned (padding on the left) unless the mask shows right padding.

Legend: B batch rows, T tokens, T2 tokens after expansion, D text hidden, V vocabulary, N image rows.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from openk3.config import K3Config
from openk3.model.hf import load_pretrained, save_pretrained
from openk3.model.model import CausalLMOutput, K3ForCausalLM, keeps_fp32
from openk3.model.vision import MoonViT3d, PatchMergerMLPV2, VisionConfig, init_vision_weights


def placeholder_spans(is_ph_BT: torch.Tensor, rows_N: list[int], token_id: int) -> list[tuple[list[int], bool]]:
    """For image k: (flat positions of its placeholders, expand?) where expand means one placeholder stands for
    all N_k rows. Raises ValueError naming the image and the counts when the placeholders do not fit."""
    flat = is_ph_BT.flatten().nonzero().flatten().tolist()
    n, T = len(rows_N), is_ph_BT.shape[1]
    if len(flat) == n:
        return [([pos], N > 1) for pos, N in zip(flat, rows_N)]
    if len(flat) == sum(rows_N):
        starts = [sum(rows_N[:k]) for k in range(n)]
        return [(flat[s : s + N], False) for s, N in zip(starts, rows_N)]
    # Mixed conventions: one run of consecutive placeholders per image, of length 1 or N_k.
    runs: list[list[int]] = []
    for pos in flat:
        if runs and pos == runs[-1][-1] + 1 and pos % T != 0:
            runs[-1].append(pos)
        else:
            runs.append([pos])
    if len(runs) == n:
        for k, (run, N) in enumerate(zip(runs, rows_N)):
            if len(run) not in (1, N):
                raise ValueError(f"image {k} has {N} rows but {len(run)} consecutive placeholder tokens (id {token_id}) "
                                 f"stand at its place: give 1 (expanded) or {N} (replaced in place)")  # fmt: skip
        return [(run, len(run) == 1 and N > 1) for run, N in zip(runs, rows_N)]
    raise ValueError(f"{len(flat)} placeholder tokens (id {token_id}) in {len(runs)} runs for {n} images of {rows_N} "
                     f"rows: give 1 placeholder per image (expanded) or N_i consecutive ones (replaced in place)")  # fmt: skip


class K3ForConditionalGeneration(nn.Module):
    """K3 with its vision tower. `K3ForConditionalGeneration.from_pretrained(dir)` of a checkpoint with a
    `vision_config`; parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`, `language_model.*`
    with the text model's own exceptions in model/hf.py)."""

    def __init__(self, config: K3Config | str):
        super().__init__()
        if isinstance(config, str):
            config = K3Config.preset(config)
        if config.vision_config is None:
            raise ValueError("config has no vision_config (a text-only checkpoint): load it with K3ForCausalLM")
        self.config = config
        self.vision = VisionConfig.from_dict(config.vision_config)
        if self.vision.text_hidden_size != config.text_config.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size {self.vision.text_hidden_size} != text_config."
                             f"hidden_size {config.text_config.hidden_size}")  # fmt: skip
        self.vision_tower = MoonViT3d(self.vision)
        self.mm_projector = PatchMergerMLPV2(self.vision)
        self.language_model = K3ForCausalLM(config)

    @property
    def text_config(self):
        return self.config.text_config

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """From-scratch init: the text model as `K3ForCausalLM.init_weights` documents, the tower and projector as
        `vision.init_vision_weights` documents (every tensor listed there)."""
        self.language_model.init_weights(generator)
        init_vision_weights(self.vision_tower, self.mm_projector, generator)

    def to_dtype(self, dtype: torch.dtype) -> K3ForConditionalGeneration:
        """Everything to `dtype` (the release casts the tower and projector to the text model's dtype), except
        the text tensors the release keeps in fp32."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if keeps_fp32(name) else dtype)
        return self

    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token): the text model's counts plus every tower and projector parameter."""
        total, active = self.language_model.num_parameters()
        return total + self.num_vision_parameters(), active + self.num_vision_parameters()

    def num_vision_parameters(self) -> int:
        return sum(p.numel() for m in (self.vision_tower, self.mm_projector) for p in m.parameters())

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [L, 3, p, p] (the processor's patches of all images), grid_thws [n, 3] -> the projector
        rows of each image, [N_i, D] with N_i = t_i... merged to (h_i/2)(w_i/2)."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def merge_image_rows(self, input_ids, features: list[torch.Tensor], attention_mask=None, labels=None):
        """Text embeddings of `input_ids` [B, T] with the image rows put at the placeholders (module docstring).
        Returns (ids [B, T2] (placeholder id on image rows), embeds [B, T2, D], mask [B, T2], labels [B, T2] with
        ignore_index on image rows and padding, or None)."""
        B, T = input_ids.shape
        token_id, pad = self.config.media_placeholder_token_id, self.text_config.pad_token_id
        mask_BT = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        spans = placeholder_spans((input_ids == token_id) & mask_BT, [f.shape[0] for f in features], token_id)
        embeds_BTD = self.language_model.model.embed_tokens(input_ids)
        feats_ND = torch.cat(features).to(embeds_BTD.dtype)
        # Row sources index one table: the B*T text rows, then the image rows.
        source = torch.arange(B * T, device=input_ids.device)
        expand_at: dict[int, torch.Tensor] = {}
        offset = B * T
        for k, (positions, expand) in enumerate(spans):
            rows_N = torch.arange(offset, offset + features[k].shape[0], device=input_ids.device)
            offset += features[k].shape[0]
            if expand:
                expand_at[positions[0]] = rows_N
            else:
                source[positions] = rows_N
        per_row, lengths = [], []
        for b in range(B):
            pieces, start = [], b * T
            for pos in sorted(p for p in expand_at if b * T <= p < (b + 1) * T):
                pieces += [source[start:pos], expand_at[pos]]
                start = pos + 1
            pieces.append(source[start : (b + 1) * T])
            per_row.append(torch.cat(pieces))
            lengths.append(per_row[-1].numel())
        T2 = max(lengths)
        right_padded = attention_mask is not None and not bool(mask_BT[:, -1].all())
        filler = -1  # positions a shorter row leaves empty
        index_BT2 = torch.full((B, T2), filler, dtype=torch.long, device=input_ids.device)
        for b, row in enumerate(per_row):
            if right_padded:
                index_BT2[b, : row.numel()] = row
            else:
                index_BT2[b, T2 - row.numel() :] = row
        valid = index_BT2 != filler
        safe = index_BT2.clamp(min=0)
        table_D = torch.cat([embeds_BTD.flatten(0, 1), feats_ND])
        embeds2 = table_D[safe] * valid[..., None]
        is_text = valid & (safe < B * T)
        text_pos = safe.clamp(max=B * T - 1)
        ids2 = torch.where(is_text, input_ids.flatten()[text_pos], torch.full_like(safe, token_id))
        ids2 = torch.where(valid, ids2, torch.full_like(safe, pad if pad is not None else 0))
        mask2 = valid & torch.where(is_text, mask_BT.flatten()[text_pos], torch.ones_like(valid))
        labels2 = None
        if labels is not None:
            ignore = torch.full_like(safe, self.config.ignore_index)
            labels2 = torch.where(is_text, labels.flatten()[text_pos].to(safe), ignore)
        return ids2, embeds2, mask2, labels2

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> CausalLMOutput | torch.Tensor:
        """input_ids [B, T] with media placeholders, the processor's pixel_values [L, 3, p, p] and grid_thws
        [n, 3] -> what `K3ForCausalLM.forward` returns, over the grown sequence [B, T2] when a placeholder was
        expanded. `labels` [B, T] are carried to the grown sequence with ignore_index on image rows."""
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pass pixel_values and grid_thws together")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if pixel_values is None:
            return self.language_model(input_ids, attention_mask, labels=labels, return_dict=return_dict)
        features = self.encode_images(pixel_values, grid_thws)
        ids, embeds, mask, labels = self.merge_image_rows(input_ids, features, attention_mask, labels)
        has_padding = attention_mask is not None or not bool(mask.all())
        return self.language_model(ids, mask if has_padding else None, labels=labels, return_dict=return_dict,
                                   inputs_embeds=embeds)  # fmt: skip

    def forward_batch(self, batch, pixel_values: torch.Tensor | None = None,
                      grid_thws: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Packed forward (`ForwardBatch`, no padding): logits [T, V], as `K3ForCausalLM.forward_batch`, with the
        images' rows put in place of their placeholders. Each image needs its N placeholders in the ids (the
        packed stream cannot grow); one placeholder standing for N > 1 rows is an error here."""
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pass pixel_values and grid_thws together")
        embeds_TD = None
        if pixel_values is not None:
            features = self.encode_images(pixel_values, grid_thws)
            ids_1T = batch.input_ids_T[None]
            ids, embeds_1TD, _, _ = self.merge_image_rows(ids_1T, features)
            if ids.shape != ids_1T.shape:
                raise ValueError("forward_batch needs N placeholder tokens per image (the packed stream cannot "
                                 "grow); expand one-placeholder prompts first")  # fmt: skip
            embeds_TD = embeds_1TD[0]
        return self.language_model.forward_batch(batch, embeds_TD)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> K3ForConditionalGeneration:  # fmt: skip
        """Load a checkpoint with its vision tensors (stored dtypes kept when dtype=None: bf16 in the release)."""
        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int | None = None) -> None:
        """Write config.json + safetensors under the official names, vision tensors included."""
        save_pretrained(self, path, max_shard_size=max_shard_size)
