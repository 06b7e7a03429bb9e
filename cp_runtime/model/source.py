"""Where a served model's weights come from: a description that every process can load on its
own (an executor is built from a source, never from another process's arrays).

    WeightsSource(model="tiny", seed=0)          random weights of a config (reproducible)
                                                 and the byte tokenizer
                                                 (cp_runtime.model.byte_tokenizer)
    WeightsSource(model="recall")                the hand-built retrieval model
                                                 (cp_runtime.model.recall), the byte tokenizer
                                                 with its tokens named
    WeightsSource(checkpoint="DIR")              a Hugging Face checkpoint: config, weights,
                                                 tokenizer (cp_runtime.weights.checkpoint)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cp_runtime.config import ModelConfig, load_model_config
from cp_runtime.model.byte_tokenizer import toy_tokenizer
from cp_runtime.model.recall import build_recall_model
from cp_runtime.weights.checkpoint import (CheckpointBlocks, check_tokenizer, load_tokenizer,
                                           read_hf_config)
from cp_runtime.weights.params import Params, init_params
from cp_runtime.weights.placement import BlockSource

__all__ = ["LoadedModel", "WeightsSource", "RECALL_MODEL"]

RECALL_MODEL = "recall"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its config, its weights and its tokenizer (None when the model
    has none: token ids only). The weights are arrays in memory (HF names), or for a checkpoint
    a block source that reads each device's part from the files only when it is placed
    (cp_runtime.weights.placement), so a process never holds the whole checkpoint."""

    config: ModelConfig
    weights: Params | BlockSource
    tokenizer: Any = None


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """A model config name (random weights from `seed`, or the recall model's hand-set ones),
    or a checkpoint directory, which wins when given."""

    model: str = "tiny"
    checkpoint: str | None = None
    seed: int = 0

    @property
    def name(self) -> str:
        return self.checkpoint or self.model

    def config(self) -> ModelConfig:
        """The model config alone, without loading any weight."""
        if self.checkpoint is not None:
            return read_hf_config(self.checkpoint)
        return load_model_config(self.model)

    def tokenizer(self, config: ModelConfig | None = None):
        """The tokenizer alone: a checkpoint's (checked against its config), else the byte
        tokenizer of a built-in model (None without the `tokenizers` package)."""
        config = config or self.config()
        if self.checkpoint is not None:
            tokenizer = load_tokenizer(self.checkpoint)
            check_tokenizer(self.checkpoint, config, tokenizer)
            return tokenizer
        return toy_tokenizer(config, recall=self.model == RECALL_MODEL)

    def load(self) -> LoadedModel:
        cfg = self.config()
        tokenizer = self.tokenizer(cfg)
        if self.checkpoint is not None:
            return LoadedModel(cfg, CheckpointBlocks(self.checkpoint, cfg), tokenizer)
        if self.model == RECALL_MODEL:
            return LoadedModel(cfg, build_recall_model(cfg, seed=self.seed).params, tokenizer)
        return LoadedModel(cfg, init_params(cfg, seed=self.seed), tokenizer)
