"""TRL 1.16.0 ``SFTTrainer`` (transformers 5.9.0 + accelerate, FSDP2) resumed exactly by ``integrations.dsd``.

The trainer drill with the real package: 2 Gloo ranks, FSDP2 over a CPU mesh, the drill MoE of
:mod:`dsd_moe` as a causal LM (what ``SFTTrainer`` trains: an embedding, the two MoE layers of which
experts 4-7 are never routed, the ``vision`` tower that never runs, in its own AdamW group whose lr
a LambdaLR moves, and an LM head: 40 parameters, 22 with gradients), 5 SFT steps with a checkpoint
after step 3 through the Trainer's own checkpointing (accelerate's ``save_fsdp_optimizer``: DSD's
``get_optimizer_state_dict`` + ``dcp.save``), resumed in fresh processes with
``trainer.train(resume_from_checkpoint=...)``:

- stock (pinned): the resume fails with ``Missing key in checkpoint state_dict: ...
  layers.0.experts.4.weight.step`` after DSD's synthetic step put state on all 40 parameters;
- with ``sparse_ckpt.integrations.dsd.install()`` after ``from trl import SFTTrainer``: the stock and
  the installed checkpoint both resume, the next two steps equal the uninterrupted run bit for bit,
  22 parameters with state, ``vision``'s lr the scheduler's.

The CPU FSDP2 recipe and the runs are the Hugging Face ``Trainer`` drill's (:mod:`hf_cpu_fsdp2`,
:mod:`hf_drill`; ``SFTTrainer`` is a ``transformers.Trainer``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="trl is not installed (pip install --no-deps -r .ci/requirements-trl.txt)")

import _backends
import dsd_moe
import hf_drill
import torch
from _dist import MULTI_RANK, run_ranks
from hf_cpu_fsdp2 import cpu_fsdp2
from torch import nn

pytestmark = [
    pytest.mark.slow,  # a trainer drill: the fast tier (-m 'not slow') leaves it out
    *MULTI_RANK,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]

VOCAB = 16
STOCK_ERROR = r"Missing key in checkpoint state_dict: optimizer\.state\.model\.layers\.0\.experts\.4\.weight\.step"


def model_class() -> type:
    """The drill MoE as a transformers causal LM (built here: transformers is imported lazily)."""
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, dsd_moe.DIM)
            self.layers = nn.ModuleList(dsd_moe.MoeLayer() for _ in range(2))
            self.vision = nn.Linear(dsd_moe.DIM, dsd_moe.DIM)  # never runs

        def forward(self, input_ids: torch.Tensor, **_kwargs: Any) -> Any:
            x = self.embed(input_ids)
            shape = x.shape
            x = x.reshape(-1, dsd_moe.DIM)
            for layer in self.layers:
                x = layer(x)
            return BaseModelOutput(last_hidden_state=x.reshape(shape))

    class MoeLM(PreTrainedModel):
        config_class = PretrainedConfig
        base_model_prefix = "model"
        _no_split_modules = ["MoeLayer"]  # noqa: RUF012 (transformers reads a list)

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = Backbone()
            self.lm_head = nn.Linear(dsd_moe.DIM, VOCAB, bias=False)
            self.generation_config = GenerationConfig()

        def _init_weights(self, module: nn.Module) -> None:  # keep torch's initialisation (seeded)
            pass

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def get_input_embeddings(self) -> nn.Module:
            return self.model.embed

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
            logits = self.lm_head(self.model(input_ids, **kwargs).last_hidden_state)
            loss = None
            if labels is not None:
                loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
            return CausalLMOutput(loss=loss, logits=logits)

    return MoeLM


def make_model() -> nn.Module:
    from transformers import PretrainedConfig

    torch.manual_seed(0)
    config = PretrainedConfig(vocab_size=VOCAB, hidden_size=dsd_moe.DIM, tie_word_embeddings=False)
    return model_class()(config)


def tokenizer() -> Any:
    """A word-level tokenizer over :data:`VOCAB` tokens, built locally (no hub)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )


def dataset() -> Any:
    """4 pre-tokenized sequences (one optimizer step per epoch on 2 ranks, 2 each)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(7)
    return Dataset.from_dict({"input_ids": torch.randint(2, VOCAB, (4, 6), generator=gen).tolist()})


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    vision = [p for n, p in model.named_parameters() if ".vision." in n]
    rest = [p for n, p in model.named_parameters() if ".vision." not in n]
    return [{"params": rest, "lr": 0.01}, {"params": vision, "lr": dsd_moe.VISION_LR}]


def trainer(output_dir: str) -> Any:
    """A fresh SFTTrainer on a fresh model (seed 0), FSDP2 on CPU, AdamW (two groups) and LambdaLR."""
    from trl import SFTConfig, SFTTrainer

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(model), lr=0.01)

    args = SFTConfig(
        output_dir=output_dir,
        gradient_checkpointing=False,  # SFTConfig's default is True; the drill MoE has no checkpointing
        **hf_drill.TRAINING_ARGS,
    )
    return cpu_fsdp2(SFTTrainer, adamw)(
        model=make_model(), args=args, train_dataset=dataset(), processing_class=tokenizer()
    )


@_backends.only(_backends.DEFAULT)
def test_trl_sft_trainer_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    """TRL's SFTTrainer: stock resume fails (18 invented states); with ``install()`` both checkpoints
    resume bit-exactly with 22 states and the scheduler's lrs."""
    run_ranks(functools.partial(hf_drill.uninterrupted, trainer), 2, str(tmp_path), timeout=300)
    run_ranks(functools.partial(hf_drill.resumed, trainer, STOCK_ERROR), 2, str(tmp_path), timeout=300)
