"""Hugging Face's own loops and model tricks through torchdp, each compared with the model on one
device: a real ``transformers.Trainer`` forced to several CPU replicas under
``torchdp.patch_torch()`` (with a short last batch), a ``types.MethodType`` forward and
accelerate's ``add_hook_to_module``, output-capturing hooks of ``output_hidden_states``, the KV
caches of Llama, Qwen2 and Mistral (sliding window), and a PEFT LoRA model.

Tiny configs are built here; nothing is downloaded. A test skips when its package is absent.
"""

from __future__ import annotations

import copy
import os
import tempfile
import types
import warnings

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 1e-5}
VOCAB = 50


@pytest.fixture(autouse=True)
def _quiet():
    """Gather's warning about 0-dim losses (one per replica) and transformers' notices."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _decoder(kind: str, seed: int = 0) -> nn.Module:
    """A tiny Llama, Qwen2 or Mistral (sliding window of 4) causal LM, in eval mode."""
    torch.manual_seed(seed)
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    if kind == "mistral":
        config = transformers.MistralConfig(sliding_window=4, **common)
        return transformers.MistralForCausalLM(config).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def _ids(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------


class _Samples(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.ids = _ids(count, 6, seed=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train_with_trainer(model: nn.Module, n_gpu: int, batch: int, samples: int) -> torch.Tensor:
    """The losses a real Trainer returns step by step, with ``args._n_gpu = n_gpu``."""

    class Recording(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            step_losses.append(float(loss))
            return loss

    step_losses: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out,
            per_device_train_batch_size=batch,
            num_train_epochs=2,
            learning_rate=0.05,
            optim="sgd",  # AdamW would turn rounding noise in the key biases' (zero) gradients
            report_to=[],  # into whole steps
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        args._n_gpu = n_gpu  # what TrainingArguments finds with n_gpu GPUs and no launcher
        Recording(model=model, args=args, train_dataset=_Samples(samples)).train()
    return torch.tensor(step_losses)


@pytest.mark.parametrize(("replicas", "samples"), [(2, 8), (2, 9), (3, 10)])
def test_trainer_under_patch_torch_trains_as_on_one_device(replicas, samples):
    # Batches of 2 per replica. With 9 and 10 samples each epoch's last batch (1 of 4 samples; 4
    # of 6) splits into fewer chunks than replicas, while num_items_in_batch comes with one row
    # per replica.
    got_model: list[float] = []  # the model's loss: the sum of the replicas' losses, each
    ran: list[int] = []  # normalised by the batch's token count (num_items_in_batch)

    class OnCpus(torchdp.DataParallel):
        def __init__(self, module, *args, **kwargs):
            super().__init__(module, devices=cpu_devices(replicas))

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            got_model.append(float(out["loss"].detach().sum()))
            ran.append(out["loss"].numel())
            return out

    model, ref = _gpt2(), _gpt2()
    with torchdp.patch_torch():
        assert torch.nn.DataParallel is torchdp.DataParallel
        torch.nn.DataParallel = OnCpus
        try:
            got = _train_with_trainer(model, replicas, 2, samples)
        finally:
            torch.nn.DataParallel = torchdp.DataParallel
    want_model: list[float] = []
    ref.register_forward_hook(lambda m, args, out: want_model.append(float(out["loss"].detach())))
    want = _train_with_trainer(ref, 1, 2 * replicas, samples)
    assert len(got) == len(want) >= 4
    assert (min(ran) < replicas) == (samples % (2 * replicas) != 0)  # short batches ran
    # The model's loss equals the one-device model's at every step, the short batches included.
    torch.testing.assert_close(torch.tensor(got_model), torch.tensor(want_model), **TOL)
    # The Trainer averages the gathered losses and multiplies by n_gpu (trainer.py's own
    # arithmetic for nn.DataParallel): exact when every replica runs, scaled by replicas / ran
    # when fewer do, whichever DataParallel runs them.
    torch.testing.assert_close(got, want * torch.tensor([replicas / k for k in ran]), **TOL)
    # The parameters too: the scaled steps' gradients are clipped to the same norm (the Trainer's
    # default max_grad_norm=1 is below these gradients' norms), so their updates are the same.
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name, **TOL)


# ---------------------------------------------------------------------------------------------
# Rebound forwards: each replica runs its own parameters
# ---------------------------------------------------------------------------------------------


def _record_heads(model: nn.Module, seen: list[nn.Module]) -> None:
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(module))


def _check_replica_calls(model, ref, seen_roots, seen_heads, replicas):
    """The calls ran on distinct replicas (never the user's modules); outputs and gradients
    equal the one-device model's."""
    ids = _ids(6, 5, seed=2)
    out = torchdp.DataParallel(model, devices=cpu_devices(replicas))(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids)
    assert len(seen_roots) == len(seen_heads) == replicas
    assert len({id(m) for m in seen_roots}) == replicas and model not in seen_roots
    assert len({id(m) for m in seen_heads}) == replicas and model.lm_head not in seen_heads
    for head in seen_heads:
        # The replica's copy of the weight, not the user's parameter.
        assert head.weight is not model.lm_head.weight and head.weight.grad_fn is not None
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    out.loss.mean().backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name, **TOL)


def test_method_type_forward_runs_each_replica():
    model, ref = _gpt2(), _gpt2()
    seen_roots: list[nn.Module] = []
    seen_heads: list[nn.Module] = []
    plain_forward = type(model).forward

    def forward(self, *args, **kwargs):  # as TRL binds its own forward
        seen_roots.append(self)
        return plain_forward(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    _record_heads(model, seen_heads)
    _check_replica_calls(model, ref, seen_roots, seen_heads, replicas=3)
    assert model.forward.__self__ is model  # the user's module is left as it was


def test_accelerate_hooked_model_runs_each_replica():
    hooks = pytest.importorskip("accelerate.hooks")
    model, ref = _gpt2(), _gpt2()
    seen_roots: list[nn.Module] = []
    seen_heads: list[nn.Module] = []

    class Probe(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen_roots.append(module)
            return args, kwargs

    hooks.add_hook_to_module(model, Probe())
    _record_heads(model, seen_heads)
    _check_replica_calls(model, ref, seen_roots, seen_heads, replicas=2)
    assert model.forward.args[0] is model and model._old_forward.__self__ is model


def test_output_hidden_states_leaves_no_hooks_in_the_model():
    model = _decoder("llama")
    ref = copy.deepcopy(model)
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    dp = torchdp.DataParallel(model, devices=cpu_devices(3))
    for step in range(20):
        ids = _ids(5, 4, seed=step)
        out = dp(input_ids=ids, output_hidden_states=True)
        assert len(out.hidden_states) == 3, f"step {step}"
        assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    want = ref(input_ids=ids, output_hidden_states=True)
    for got, expected in zip(out.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    assert len(model(input_ids=ids, output_hidden_states=True).hidden_states) == 3


# ---------------------------------------------------------------------------------------------
# KV caches
# ---------------------------------------------------------------------------------------------


def _assert_caches_equal(got, want) -> None:
    assert type(got) is type(want) and len(got.layers) == len(want.layers)
    assert got.get_seq_length() == want.get_seq_length()
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert type(a) is type(b)
        state_a, state_b = vars(a), vars(b)
        assert state_a.keys() == state_b.keys()
        for key, value in state_b.items():
            if isinstance(value, torch.Tensor):
                assert state_a[key].shape == value.shape, (i, key)
                torch.testing.assert_close(state_a[key], value, msg=f"layer {i} {key}", **TOL)
            else:
                assert state_a[key] == value, (i, key)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_cache_gathers_along_the_batch_and_goes_back_in(kind):
    model = _decoder(kind)
    dp = torchdp.DataParallel(model, devices=cpu_devices(3))
    ids = _ids(5, 6, seed=3)  # chunks of 2, 2 and 1 rows; 6 tokens, past Mistral's window
    with torch.no_grad():
        out = dp(input_ids=ids, use_cache=True)
        want = model(input_ids=ids, use_cache=True)
    torch.testing.assert_close(out.logits, want.logits, **TOL)
    _assert_caches_equal(out.cache, want.cache)

    # The gathered cache as an input: split by batch, one step further on each replica.
    step = _ids(5, 1, seed=4)
    mask = torch.ones(5, 7, dtype=torch.long)
    with torch.no_grad():
        nxt = dp(input_ids=step, attention_mask=mask, cache=out.cache, use_cache=True)
        ref = model(input_ids=step, attention_mask=mask, cache=want.cache, use_cache=True)
    torch.testing.assert_close(nxt.logits, ref.logits, **TOL)
    _assert_caches_equal(nxt.cache, ref.cache)
    assert out.cache.get_seq_length() == 6  # the replicas updated their own copies


def test_encoder_decoder_cache_gathers_and_goes_back_in():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    model = transformers.BartForConditionalGeneration(config).eval()
    dp = torchdp.DataParallel(model, devices=cpu_devices(3))
    ids, decoder_ids = _ids(5, 6, seed=6), _ids(5, 4, seed=7)
    with torch.no_grad():
        out = dp(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=True)
        want = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=True)
    assert type(out.cache) is type(want.cache) and out.cache.is_updated == want.cache.is_updated
    for part in ("self_attention_cache", "cross_attention_cache"):
        _assert_caches_equal(getattr(out.cache, part), getattr(want.cache, part))
    step = _ids(5, 1, seed=8)
    with torch.no_grad():
        nxt = dp(
            encoder_outputs=(out.encoder_last_hidden_state,),
            decoder_input_ids=step,
            cache=out.cache,
            use_cache=True,
        )
        ref = model(
            encoder_outputs=(want.encoder_last_hidden_state,),
            decoder_input_ids=step,
            cache=want.cache,
            use_cache=True,
        )
    torch.testing.assert_close(nxt.logits, ref.logits, **TOL)
    _assert_caches_equal(nxt.cache.self_attention_cache, ref.cache.self_attention_cache)


def test_a_cache_that_cannot_be_joined_names_use_cache_false():
    # A static cache's layers record their batch size: 2, 2 and 1 after an uneven split.
    model = _decoder("llama")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with (
        pytest.raises(
            TypeError,
            match=r"StaticCache objects along dim 0: its attribute "
            r"'layers.batch_size' differs between replicas \(\[2, 2, 1\]\).*"
            r"use_cache=False",
        ),
        torch.no_grad(),
    ):
        torchdp.DataParallel(model, devices=cpu_devices(3))(
            input_ids=_ids(5, 6, seed=9), cache=cache, use_cache=True
        )


# ---------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------


def test_peft_lora_trains_as_on_one_device():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
    )
    model = peft.get_peft_model(_gpt2(), config)
    ref = peft.get_peft_model(_gpt2(), config)
    ref.load_state_dict(model.state_dict())
    dp = torchdp.DataParallel(model, devices=cpu_devices(3))
    ids = _ids(6, 5, seed=5)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = dp(input_ids=ids, labels=ids).loss.mean()
        want = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, want, **TOL)
        loss.backward()
        want.backward()
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name, **TOL)
