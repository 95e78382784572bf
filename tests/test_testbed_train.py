"""Training of the embedded testbed backbones: fast experts, losses, packing,
resume, and the shipped models."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lab.testbed.cpu_parallel import ThreadTuner
from lab.testbed.train import (
    FAST_EXPERTS,
    STATE_FILE,
    RouterCapture,
    TrainConfig,
    backbone_config,
    build_model,
    load_balancing_loss,
    lr_at,
    make_batch,
    make_batches,
    pack,
    pack_rows,
    prepare_tokenizer,
    step_losses,
    train,
    training_losses,
)
from slimwise.testbed.tasks import FAMILIES, make_split

# A tiny model of each backbone: fast enough for a few training steps in a test.
TINY = {
    "a": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
              num_experts_per_tok=2),
    "c": dict(hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
              linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
              moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
              num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return prepare_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_config(tmp_path, backbone="a", **kw) -> TrainConfig:
    args = dict(backbone=backbone, out=str(tmp_path / f"run-{backbone}"), minutes=None, max_steps=4,
                model_overrides=TINY[backbone], samples_per_family=1, lr=3e-3, warmup_steps=2, threads=1,
                progress=False, log_every=1, family_weights={})
    return TrainConfig(**(args | kw))


def test_backbone_presets_meet_the_issue(tok):
    a = backbone_config("a", tok)
    assert a.model_type == "qwen3_moe" and a.num_experts >= 64 \
        and a.num_experts_per_tok == 8 and a.norm_topk_prob
    b = backbone_config("b", tok)
    assert b.model_type == "qwen2_moe" and b.num_experts >= 32 and b.shared_expert_intermediate_size > 0
    c = backbone_config("c", tok)  # Qwen3.6-35B-A3B's design at small scale
    assert c.model_type == "qwen3_5_moe_text" and c.num_experts >= 64 and c.num_experts_per_tok == 8
    assert c.shared_expert_intermediate_size > 0 and c.shared_expert_intermediate_size % 32 == 0
    assert c.num_hidden_layers % 4 == 0  # 3 Gated-DeltaNet layers, then one full-attention layer
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (c.num_hidden_layers // 4)
    assert c.linear_key_head_dim == c.linear_value_head_dim == 64  # vLLM's CPU GDN kernel rejects 32
    assert c.linear_num_value_heads == 2 * c.linear_num_key_heads  # the reference's 32 : 16
    # transformers' default for the family, as published
    assert c.rope_parameters["partial_rotary_factor"] == 0.25
    for cfg in (a, b, c):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert cfg.vocab_size == len(tok) and cfg.max_position_embeddings == 512
        assert cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0 and head_dim >= 32
        assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize("backbone", ["a", "b", "c"])
def test_fast_experts_match_stock_eager_forward_and_backward(tmp_path, tok, backbone):
    cfg = tiny_config(tmp_path, backbone, model_overrides=TINY[backbone] | {"initializer_range": 0.2})
    model = build_model(cfg, tok)
    ids = torch.randint(0, len(tok), (3, 17), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in (FAST_EXPERTS, "eager"):
        model.zero_grad()
        model.set_experts_implementation(impl)
        logits = model(input_ids=ids, use_cache=False).logits
        (logits.float() ** 2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (logits.detach(), grads)
    fast, eager = results[FAST_EXPERTS], results["eager"]
    torch.testing.assert_close(fast[0], eager[0], rtol=1e-5, atol=1e-5)
    assert fast[1].keys() == eager[1].keys()
    assert any("experts.gate_up_proj" in n for n in fast[1]) and any("mlp.gate.weight" in n for n in fast[1])
    for name in eager[1]:
        torch.testing.assert_close(fast[1][name], eager[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_aux_loss_is_one_for_uniform_routing_and_larger_when_collapsed():
    num_tokens, num_experts, top_k = 64, 16, 4
    logits = torch.zeros(num_tokens, num_experts)  # uniform probabilities
    balanced = (torch.arange(num_tokens * top_k) % num_experts).view(num_tokens, top_k)
    assert load_balancing_loss(logits, balanced, num_experts).item() == pytest.approx(1.0, abs=1e-6)
    collapsed_logits = torch.zeros(num_tokens, num_experts)
    collapsed_logits[:, :top_k] = 5.0
    collapsed = torch.arange(top_k).expand(num_tokens, top_k)
    assert load_balancing_loss(collapsed_logits, collapsed, num_experts).item() > 3.0
    # padding rows are ignored
    valid = torch.ones(num_tokens, dtype=torch.bool)
    valid[32:] = False
    mixed = torch.cat([balanced[:32], collapsed[32:]])
    assert load_balancing_loss(logits, mixed, num_experts, valid).item() == pytest.approx(1.0, abs=1e-6)


def test_pair_init_starts_spaced_and_bare_names_equal(tmp_path, tok):
    from lab.testbed.train import word_pairs

    pairs = word_pairs(tok)
    assert ("Bob", " Bob") in [(tok.decode([a]), tok.decode([b])) for a, b in pairs] and len(pairs) >= 10
    model = build_model(tiny_config(tmp_path), tok)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    for bare, spaced in pairs:
        assert torch.equal(emb[bare], emb[spaced]) and torch.equal(head[bare], head[spaced])
    plain = build_model(tiny_config(tmp_path, pair_init=False), tok)
    bare, spaced = pairs[0]
    assert not torch.equal(plain.get_input_embeddings().weight[bare],
                           plain.get_input_embeddings().weight[spaced])


def test_training_losses_capture_every_moe_layer(tmp_path, tok):
    cfg = tiny_config(tmp_path)
    model = build_model(cfg, tok)
    capture = RouterCapture(model)
    loss, ce, aux = training_losses(model, capture, make_batch(cfg, tok, 0), cfg.aux_loss_coef)
    assert len(capture.records) == model.config.num_hidden_layers
    assert math.isclose(loss.item(), ce.item() + cfg.aux_loss_coef * aux.item(), rel_tol=1e-6)
    assert 0.9 < aux.item() < 2.0  # near-uniform routing at init
    assert abs(ce.item() - math.log(len(tok))) < 0.5  # untrained: about log(vocab)
    capture.remove()


def test_packing_masks_prompts_and_isolates_samples(tmp_path, tok):
    cfg = tiny_config(tmp_path)
    samples = make_split("train", 1, seed=3, families=["add", "sort", "qa", "upper"])
    from lab.testbed.tokenizer import encode_sample

    enc = [encode_sample(tok, s) for s in samples]
    batch = pack(enc, 256, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 1  # four short samples share one row
    assert int(batch["valid"].sum()) == sum(len(p) + len(t) for p, t in enc)
    assert int((batch["labels"] != -100).sum()) == sum(len(t) for _, t in enc)  # targets + EOS only
    trained = set(batch["labels"][batch["labels"] != -100].tolist())
    assert tok.eos_token_id in trained
    # the packed forward equals each sample's own forward: no attention across samples
    model = build_model(cfg, tok).eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        for (p, t), start in zip(sorted(enc, key=lambda x: -(len(x[0]) + len(x[1]))), starts, strict=False):
            ids = torch.tensor([p + t])
            alone = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(packed[:, start:start + ids.shape[1]], alone, rtol=1e-4, atol=1e-4)


def test_hybrid_packing_would_leak_so_hybrids_train_one_sample_per_row(tmp_path, tok):
    """transformers' CPU Gated-DeltaNet path (torch chunked kernel, causal conv) ignores packed-sample
    boundaries: the second sample of a packed row differs from the same sample alone. One sample per row
    (`pack_rows`, the default for hybrids) is exact, in any number of length-sorted micro-batches (at most
    `groups`), and the micro-batch losses add up to the one-batch loss."""
    from lab.testbed.tokenizer import encode_sample
    from lab.testbed.train import is_hybrid, packing_of

    cfg = tiny_config(tmp_path, "c")
    model = build_model(cfg, tok).eval()
    assert is_hybrid(model.config) and packing_of(cfg, model.config) == "rows"
    assert packing_of(tiny_config(tmp_path), build_model(tiny_config(tmp_path), tok).config) == "packed"
    enc = [encode_sample(tok, s)
           for s in make_split("train", 1, seed=3, families=["add", "sort", "qa", "upper"])]
    alone = {}
    with torch.no_grad():
        for p, t in enc:
            alone[len(p) + len(t), p[0]] = model(input_ids=torch.tensor([p + t]), use_cache=False).logits[0]
        batch = pack(enc, 256, tok.pad_token_id)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        order = sorted(enc, key=lambda x: -(len(x[0]) + len(x[1])))
        second = order[1]
        n = len(second[0]) + len(second[1])
        leak = (packed[0, starts[1]:starts[1] + n] - alone[n, second[0][0]]).abs().max().item()
        assert leak > 1e-3, leak  # the state of sample 1 reaches sample 2
        for groups in (1, 2, 4):
            for b in pack_rows(enc, tok.pad_token_id, groups=groups):
                logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                               use_cache=False).logits
                for row in range(b["input_ids"].shape[0]):
                    n = int(b["valid"][row].sum())
                    key = (n, int(b["input_ids"][row, 0]))
                    torch.testing.assert_close(logits[row, :n], alone[key], rtol=1e-4, atol=1e-4)
    model.train()
    capture = RouterCapture(model)
    one = pack_rows(enc, tok.pad_token_id, groups=1)
    three = pack_rows(enc, tok.pad_token_id, groups=3)  # at most `groups`: ceil(4 / 3) = 2 samples each
    assert len(three) == 2 and sum(int(b["valid"].sum()) for b in three) == int(one[0]["valid"].sum())
    with torch.no_grad():
        ce_one = training_losses(model, capture, one[0], 0.0)[1]
    model.zero_grad()
    loss, ce, aux = step_losses(model, capture, three, 0.02)
    torch.testing.assert_close(ce, ce_one, rtol=1e-5, atol=1e-6)
    assert math.isclose(loss.item(), ce.item() + 0.02 * aux.item(), rel_tol=1e-5) and 0.9 < aux.item() < 2.0
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n)
    steps = make_batches(cfg, tok, 0, "rows")
    assert len(steps) == cfg.row_groups \
        and all(int(b["valid"][:, 0].sum()) == b["valid"].shape[0] for b in steps)
    capture.remove()


def test_segmented_linear_attention_equals_each_sample_alone():
    """The segment-aware causal conv and chunked gated delta rule equal transformers' stock
    functions run on each sample alone: samples that straddle a chunk boundary, several starts in
    one chunk, one sample over 2 chunks."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as stock

    from lab.testbed.packed_linear_attention import (
        segment_ids,
        segmented_causal_conv1d,
        segmented_chunk_gated_delta_rule,
    )

    torch.manual_seed(0)
    lens = [[40, 70, 5, 35], [130, 20]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    seg = segment_ids(pos)
    assert seg[0].unique().numel() == 4 and seg[1].unique().numel() == 2
    b, t, h, d = 2, 150, 2, 16
    q, k, v = (torch.randn(b, t, h, d, dtype=torch.float64) for _ in range(3))
    g, beta = -0.5 * torch.rand(b, t, h, dtype=torch.float64), torch.rand(b, t, h, dtype=torch.float64)
    out = segmented_chunk_gated_delta_rule(q, k, v, g, beta, seg, use_qk_l2norm_in_kernel=True)
    x, w = torch.randn(b, 12, t, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    conv = segmented_causal_conv1d(x, w, None, "silu", seg)
    whole, _ = stock.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    for r, row in enumerate(lens):
        start = 0
        for n in row:
            s = slice(start, start + n)
            ref, _ = stock.torch_chunk_gated_delta_rule(q[r:r + 1, s], k[r:r + 1, s], v[r:r + 1, s],
                                                        g=g[r:r + 1, s], beta=beta[r:r + 1, s],
                                                        use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out[r, s], ref[0], rtol=0, atol=1e-5)  # both compute in float32
            torch.testing.assert_close(conv[r, :, s],
                                       stock.causal_conv1d_fn(x[r:r + 1, :, s], w, None, "silu")[0])
            start += n
    # unsegmented, sample 2 reads sample 1's state
    assert (whole[0, 40:110] - out[0, 40:110]).abs().max() > 1e-2


def test_packed_hybrid_rows_train_exactly_what_one_sample_per_row_trains(tmp_path, tok):
    """`--packing packed` on a hybrid: several samples per row, with the segment-aware Gated-DeltaNet swapped
    in, gives the loss and gradients of the same samples one per row (stock kernels); without the swap the
    packed loss differs (the state leaks). Outside the swap the stock functions are back."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as stock

    from lab.testbed.packed_linear_attention import segment_aware_linear_attention
    from lab.testbed.tokenizer import encode_sample

    model = build_model(tiny_config(tmp_path, "c"), tok).train()
    capture = RouterCapture(model)
    enc = [encode_sample(tok, s) for s in make_split("train", 2, seed=5)]
    packed = pack(enc, 192, tok.pad_token_id)
    assert packed["input_ids"].shape[0] < len(enc) // 2  # several samples per row

    def run(batches):
        model.zero_grad()
        loss = step_losses(model, capture, batches, 0.02)[0]
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # one micro-batch of rows: the aux loss (a product of batch means) is then over the
    # same tokens as the packed one
    ref_loss, ref_grads = run(pack_rows(enc, tok.pad_token_id, groups=1))
    leaky_loss, leaky_grads = run([packed])
    functions = (stock.causal_conv1d_fn, stock.torch_chunk_gated_delta_rule)
    with segment_aware_linear_attention():
        assert stock.torch_chunk_gated_delta_rule is not functions[1]
        loss, grads = run([packed])
    assert (stock.causal_conv1d_fn, stock.torch_chunk_gated_delta_rule) == functions
    capture.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() == leaky_grads.keys()

    def off(a, b):  # how far a gradient is outside the tolerance below (> 1: fails it)
        return ((a - b).abs() / (1e-5 + 1e-3 * b.abs())).max().item()

    assert max(off(leaky_grads[n], ref_grads[n]) for n in grads) > 10, "the control should fail the tolerance"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_batches_cover_all_families_and_are_deterministic(tmp_path, tok):
    cfg = tiny_config(tmp_path, samples_per_family=2)
    from lab.testbed.train import step_samples

    s0 = step_samples(cfg, 0)
    assert {s.family for s in s0} == set(FAMILIES) and len(s0) == 2 * len(FAMILIES)
    assert [s.prompt for s in s0] == [s.prompt for s in step_samples(cfg, 0)]
    assert [s.prompt for s in s0] != [s.prompt for s in step_samples(cfg, 1)]
    weighted = step_samples(tiny_config(tmp_path, samples_per_family=2,
                                        family_weights={"gcd": 2.0, "qa": 0.5}), 0)
    per = {f: sum(s.family == f for s in weighted) for f in FAMILIES}
    assert per["gcd"] == 4 and per["qa"] == 1 and per["add"] == 2
    b0, b0_again = make_batch(cfg, tok, 0), make_batch(cfg, tok, 0)
    assert all(torch.equal(b0[k], b0_again[k]) for k in b0)


def test_lr_schedule_and_thread_tuner():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9, 0.0) == pytest.approx(1e-3)
    assert lr_at(cfg, 500, 0.5) == pytest.approx(0.55e-3)
    assert lr_at(cfg, 900, 1.0) == pytest.approx(1e-4)
    tuner = ThreadTuner(choices=(1, 2), period=10, probe=2)
    seen = []
    for step in range(30):
        n = tuner.threads_for(step)
        seen.append(n)
        tuner.record(n, 1.0 if n == 1 else 0.5 if step < 10 else 3.0)  # 2 threads win, then turn 6x slower
    assert seen[:10] == [1, 1, 2, 2, 2, 2, 2, 2, 2, 2]  # first probe: 2 threads measured faster
    assert seen[10:20] == [1, 1, 2, 2, 1, 1, 1, 1, 1, 1]  # 2 threads turned 6x slower: 1 thread chosen
    assert seen[20:24] == [1, 1, 2, 1]  # probing 2 again: one step over 2x the reference aborts the probe
    # the chosen count turning slow re-probes at once instead of waiting for the next period
    tuner = ThreadTuner(choices=(1, 2), period=100, probe=2, patience=3)
    seen = []
    for step in range(20):
        n = tuner.threads_for(step)
        seen.append(n)
        tuner.record(n, (0.5 if step < 8 else 10.0) if n == 2 else 1.0)
    assert seen[:8] == [1, 1, 2, 2, 2, 2, 2, 2]
    assert seen[8:11] == [2, 2, 2]  # three slow steps with 2 threads...
    assert seen[11:15] == [1, 1, 2, 2]  # ...start a new probe at once, which picks 1 thread
    assert set(seen[15:]) == {1}


def test_a_few_steps_lower_the_loss(tmp_path, tok):
    cfg = tiny_config(tmp_path, max_steps=30, lr=1e-2, warmup_steps=3, samples_per_family=2)
    fixed = make_batch(cfg, tok, 10_000)  # a batch the run never trains on
    model = build_model(cfg, tok)
    capture = RouterCapture(model)
    with torch.no_grad():
        before = training_losses(model, capture, fixed, 0.0)[1].item()
    out = train(cfg)
    state = torch.load(out / STATE_FILE, weights_only=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        after = training_losses(model, capture, fixed, 0.0)[1].item()
    assert state["step"] == 30
    assert after < before - 1.0, (before, after)
    # the exported model is a stock, loadable checkpoint
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["num_experts"] == TINY["a"]["num_experts"] and cfg_json["vocab_size"] == len(tok)
    assert "experts_implementation" not in cfg_json
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id


def test_hybrid_backbone_trains_unpacked_and_exports_a_stock_checkpoint(tmp_path, tok):
    out = train(tiny_config(tmp_path, "c", max_steps=3))
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["packing"] == "rows" and summary["steps"] == 3 \
        and 0 < summary["tokens"] < summary["positions"]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3_5MoeForCausalLM" and loaded.config.model_type == "qwen3_5_moe_text"
    assert json.loads((out / "config.json").read_text())["num_experts"] == TINY["c"]["num_experts"]
    # next to a qwen3_5_moe_text config AutoTokenizer swaps in Qwen3.5's tokenizer class, which spells the
    # template words out; SlimWise's loaders read the tokenizer as saved
    from transformers import AutoTokenizer

    from lab.testbed.tokenizer import load_saved_tokenizer as load_tokenizer
    from slimwise.models import load_tokenizer as model_tokenizer

    text = "add 457+68\n"
    want = tok.encode(text, add_special_tokens=False)
    assert tok.decode(want[:1]) == "add"
    for loaded in (load_tokenizer(out), model_tokenizer(out)):
        assert loaded.encode(text, add_special_tokens=False) == want
    assert AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False) != want


def test_resume_continues_the_same_run(tmp_path, tok):
    full = train(tiny_config(tmp_path / "full", max_steps=6))
    cut_cfg = tiny_config(tmp_path / "cut", max_steps=6, stop_at_step=3)
    cut = train(cut_cfg)
    interrupted = torch.load(cut / STATE_FILE, weights_only=True)
    assert interrupted["step"] == 3 and not (cut / "config.json").exists()  # no export when interrupted
    resumed = train(tiny_config(tmp_path / "cut", max_steps=6, resume=True))
    a = torch.load(full / STATE_FILE, weights_only=True)
    b = torch.load(resumed / STATE_FILE, weights_only=True)
    assert a["step"] == b["step"] == 6 and a["tokens"] == b["tokens"]
    # the same losses after the cut (same next batches, same optimizer state), hence the same weights
    assert [r["loss"] for r in a["history"]] == pytest.approx([r["loss"] for r in b["history"]], rel=1e-5)
    for name, t in a["model"].items():
        torch.testing.assert_close(b["model"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    exp_a, exp_b = a["optimizer"]["state"], b["optimizer"]["state"]
    for k in exp_a:
        torch.testing.assert_close(exp_b[k]["exp_avg_sq"], exp_a[k]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="cannot resume"):
        train(tiny_config(tmp_path / "cut", max_steps=6, resume=True, seq_len=128))
    # a state saved before --long-top-share existed: resumed under its default, refused under another value
    state = torch.load(cut / STATE_FILE, weights_only=True)
    del state["config"]["long_top_share"]
    torch.save(state, cut / STATE_FILE)
    with pytest.raises(ValueError, match="cannot resume: long_top_share was 0.0, now 0.5"):
        train(tiny_config(tmp_path / "cut", max_steps=6, resume=True, long_top_share=0.5))
    assert train(tiny_config(tmp_path / "cut", max_steps=6, resume=True)) == resumed
    # a crafted state file (a pickle that writes a file when loaded) is refused in one line and runs nothing
    from test_distill import _Payload

    from slimwise.errors import SlimWiseError

    marker = tmp_path / "pwned"
    torch.save({"step": 1, "evil": _Payload(marker)}, cut / STATE_FILE)
    with pytest.raises(SlimWiseError, match="unreadable"):
        train(tiny_config(tmp_path / "cut", max_steps=6, resume=True))
    assert not marker.exists()


def test_rank_shares_balance_the_padded_positions(tmp_path, tok):
    """Length-sorted micro-batches are dealt longest first to the less-loaded rank: each micro-batch lands on
    exactly one rank, both ranks compute the same split, and the busier rank carries less than with every
    other micro-batch (which gave one rank the two longest of four)."""
    from lab.testbed.cpu_parallel import rank_batches

    cfg = tiny_config(tmp_path, "c", row_groups=4, samples_per_family=3, ranks=2)
    for step in range(3):
        batches = make_batches(cfg, tok, step, "rows")
        sizes = [b["input_ids"].numel() for b in batches]
        shares = [rank_batches(batches, rank, 2) for rank in range(2)]
        ids = sorted(id(b) for share in shares for b in share)
        assert ids == sorted(id(b) for b in batches)
        busiest = max(sum(b["input_ids"].numel() for b in share) for share in shares)
        strided = max(sum(sizes[0::2]), sum(sizes[1::2]))
        assert busiest <= strided and busiest <= sum(sizes) / 2 + max(sizes) / 2, (sizes, busiest)
    # four micro-batches of widths 1..4 (one row each): {4, 1} and {3, 2}
    rows = [{"input_ids": torch.zeros(1, w)} for w in (1, 2, 3, 4)]
    assert [[b["input_ids"].shape[1] for b in rank_batches(rows, r, 2)] for r in (0, 1)] == [[4, 1], [3, 2]]


@pytest.mark.parametrize("backbone", ["a", "c"])
def test_rank_shares_sum_to_the_steps_gradient(tmp_path, tok, backbone):
    """Each data-parallel rank's share of a step (packed rows or row micro-batches), normalised
    by the whole step's totals, gives gradients that add up to the one-process step's, and
    losses that add up to its losses.

    Row micro-batches (hybrids) are the same with one rank or two. A packed batch split by rows changes
    one thing, as gradient accumulation does: the load-balancing loss is taken per share
    (token-weighted), so it is off here."""
    from lab.testbed.cpu_parallel import rank_batches

    aux = 0.0 if backbone == "a" else TrainConfig.aux_loss_coef
    cfg = tiny_config(tmp_path, backbone, row_groups=4, samples_per_family=2, ranks=2, aux_loss_coef=aux)
    model = build_model(cfg, tok)
    capture = RouterCapture(model)
    batches = make_batches(cfg, tok, 0, "rows" if backbone == "c" else "packed")
    assert len(batches) == (4 if backbone == "c" else 1)
    whole = torch.stack(step_losses(model, capture, batches, cfg.aux_loss_coef))
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    got, losses = {n: torch.zeros_like(g) for n, g in want.items()}, torch.zeros(3)
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        mine = rank_batches(batches, rank, 2)
        assert mine and sum(b["input_ids"].shape[0] for b in mine) \
            < sum(b["input_ids"].shape[0] for b in batches)
        losses += torch.stack(step_losses(model, capture, batches, cfg.aux_loss_coef, rank, 2))
        for n, p in model.named_parameters():
            got[n] += p.grad
    k = 2 if backbone == "a" else 3  # (loss, ce, aux): the packed split's aux value is per share
    torch.testing.assert_close(losses[:k], whole[:k], rtol=1e-5, atol=1e-6)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-7, msg=n)


# a: packed rows split between ranks, AdamW; c: hybrid micro-batches (a packed hybrid splits rows as a does),
# Muon, whose Newton-Schulz each rank runs on its share of the matrices and broadcasts
@pytest.mark.parametrize("backbone,optimizer", [("a", "adamw"), ("c", "muon")])
def test_data_parallel_ranks_train_what_one_process_trains(tmp_path, tok, backbone, optimizer):
    """2 single-thread processes (gloo over a file store) take turns at a step's micro-batches and sum their
    gradients: the run's losses, token count and weights equal one process's on the same micro-batches (up to
    float summation order), and only rank 0 writes the log and the export."""
    kw = dict(max_steps=3, row_groups=4, samples_per_family=2, optimizer=optimizer)
    one = train(tiny_config(tmp_path / "one", backbone, **kw))
    two = train(tiny_config(tmp_path / "two", backbone, ranks=2, **kw))
    a = torch.load(one / STATE_FILE, weights_only=True)
    b = torch.load(two / STATE_FILE, weights_only=True)
    assert a["step"] == b["step"] == 3 and a["tokens"] == b["tokens"]
    # steps 2 and 3 run on the weights the first updates wrote, so equal losses mean equal training (the
    # weights themselves differ where a gradient is rounding noise: AdamW's first steps move such a weight by
    # about lr whatever its size); the ranks end bit-identical (check_in_sync raises otherwise)
    assert [r["loss"] for r in b["history"]] == pytest.approx([r["loss"] for r in a["history"]], rel=1e-4)
    assert len((two / "train_log.jsonl").read_text().splitlines()) == 3 \
        and (two / "model.safetensors").is_file()
    assert json.loads((two / "train_config.json").read_text())["ranks"] == 2


def test_muon_orthogonalises_each_expert_matrix_and_leaves_the_rest_to_adamw(tmp_path, tok):
    """`--optimizer muon`: hidden matrices and every expert's gate, up and down matrices get a Newton-Schulz
    orthogonalised momentum, scaled to AdamW's RMS; embeddings, head, routers, few-row gates and the conv stay
    on AdamW; the optimizer state survives a save and load (resume)."""
    from lab.testbed.muon import MuonAdamW, muon_parameters, orthogonalize
    from lab.testbed.train import make_optimizer

    # wide and tall: singular values in the quintic's band, not 1 exactly
    for shape in ((3, 32, 64), (3, 64, 32)):
        s = torch.linalg.svdvals(orthogonalize(torch.randn(shape, dtype=torch.float64,
                                                           generator=torch.Generator().manual_seed(1))))
        assert s.min() > 0.5 and s.max() < 1.5 and (s - 1).abs().max() > 0.05
    cfg = tiny_config(tmp_path, "c", optimizer="muon", weight_decay=0.0)
    model = build_model(cfg, tok)
    chosen = muon_parameters(model)
    names = dict(model.named_parameters())
    assert chosen["model.layers.0.mlp.experts.gate_up_proj"] == 2 \
        and chosen["model.layers.0.mlp.experts.down_proj"] == 1
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in chosen \
        and "model.layers.1.self_attn.q_proj.weight" in chosen
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.linear_attn.in_proj_a.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.linear_attn.conv1d.weight"):
        assert name in names and name not in chosen, name
    opt = make_optimizer(model, cfg)
    # Muon by row blocks (1, 2), AdamW (decay, none)
    assert isinstance(opt, MuonAdamW) and len(opt.param_groups) == 4
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in names.items()}
    before = {n: p.detach().clone() for n, p in names.items()}
    for n, p in names.items():
        p.grad = grads[n].clone()
    opt.step()
    lr = cfg.lr
    gate_up = names["model.layers.0.mlp.experts.gate_up_proj"]
    rows = gate_up.shape[1] // 2  # the gate half and the up half of every expert, each on its own
    for e in (0, gate_up.shape[0] - 1):
        for half in (slice(0, rows), slice(rows, 2 * rows)):
            # first step: momentum buffer = 0.05 g, Nesterov update = g.lerp(buf, 0.95)
            g = grads["model.layers.0.mlp.experts.gate_up_proj"][e, half]
            want = orthogonalize(g.lerp(0.05 * g, 0.95)) * 0.2 * max(g.shape) ** 0.5 * lr
            torch.testing.assert_close(
                before["model.layers.0.mlp.experts.gate_up_proj"][e, half] - gate_up[e, half], want,
                rtol=1e-4, atol=1e-7)
    # the control: one matrix for both halves differs
    fused = grads["model.layers.0.mlp.experts.gate_up_proj"][0]
    assert not torch.allclose(orthogonalize(fused)[:rows], orthogonalize(fused[:rows]), atol=1e-2)
    # resume: a fresh optimizer loaded from the state dict steps exactly as the original
    state = copy.deepcopy(opt.state_dict())  # as read back from disk: no tensor shared with `opt`
    twin = build_model(cfg, tok)
    twin.load_state_dict(model.state_dict())
    twin_opt = make_optimizer(twin, cfg)
    twin_opt.load_state_dict(state)
    for m, o in ((model, opt), (twin, twin_opt)):
        for n, p in m.named_parameters():
            p.grad = grads[n].clone()
        o.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


def test_evaluate_model_reports_families_domains_and_routing(tmp_path, tok):
    from lab.testbed.evaluate import evaluate_model

    model = build_model(tiny_config(tmp_path), tok).eval()
    model.set_experts_implementation("eager")
    r = evaluate_model(model=model, tokenizer=tok, split="test", n_per_family=2, families=["add", "sort"],
                       max_new_tokens=6)
    assert set(r["families"]) == {"add", "sort"} and set(r["domains"]) == {"arithmetic", "lists"}
    assert r["n"] == 4 and 0.0 <= r["accuracy"] <= 1.0 and r["mean_tokens"] <= 6
    routing = r["routing"]
    assert len(routing["max_share_over_uniform"]) == model.config.num_hidden_layers
    assert all(1.0 <= x <= model.config.num_experts for x in routing["max_share_over_uniform"])


def test_train_command_refuses_zero_ranks_before_writing(tmp_path, capsys):
    from lab.testbed.train import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main(["--backbone", "c", "--out", str(tmp_path / "run"), "--ranks", "0", "--no-progress"])
    assert exc.value.code == 2 and "--ranks: 0 is outside" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_cards_command_parses_back_to_every_option_it_was_made_from():
    """`train_command` spells each option that differs from its default (every option changed here), so the
    command pasted into a shell trains the same run: the generic inverse of the option declarations."""
    import dataclasses
    import shlex

    from lab.testbed.evaluate import train_command
    from lab.testbed.train import build_parser
    from lab.testbed.train_config import TRAIN_OPTIONS, TrainConfig
    from slimwise.options import config_from_args, option_fields

    changed = TrainConfig(
        backbone="c", out="runs/x y", init_from="testbed-c", minutes=12.5, max_steps=7, seed=3, resume=True,
        model_overrides={"max_position_embeddings": 1152,
                         "layer_types": ["linear_attention", "full_attention"]},
        samples_per_family=2, family_weights={"add": 0.5, "lookup": 12.0}, long_max_length=512,
        long_top_share=0.3, seq_len=1088, packing="rows", row_groups=2, pair_init=False, spaced_pairs=False,
        lr=1e-3, warmup_steps=20, optimizer="muon", threads=1, ranks=2, experts_implementation="eager",
        eval_n_per_family=10, heldout_n_per_family=5)
    default = TrainConfig()
    assert all(getattr(changed, k) != getattr(default, k) for k in TRAIN_OPTIONS)
    assert set(TRAIN_OPTIONS) | {"progress"} == set(option_fields(TrainConfig))  # the card spells them all
    command = train_command(dataclasses.asdict(changed), Path("ignored"))
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "slimwise.testbed.train"] and "'runs/x y'" in command
    assert config_from_args(TrainConfig, build_parser().parse_args(words[3:])) == changed
    assert train_command({"backbone": "a"}, Path("runs/a")) == (
        "python -m slimwise.testbed.train --backbone a --out runs/a --seed 0")


def test_a_cards_command_spells_run_directories_relative_to_where_they_live(tmp_path, monkeypatch):
    """train stores absolute paths; a card spells them relative to the directory that holds them, the same
    from any working directory (CI re-renders the committed cards in another checkout), so its commands paste
    into any checkout; a shipped name stays a name."""
    from lab.testbed.evaluate import shown_command, shown_runs, train_command

    tc = {"backbone": "a", "out": str(tmp_path / "runs" / "a2"), "init_from": str(tmp_path / "runs" / "a1")}
    expected = "python -m slimwise.testbed.train --backbone a --out a2 --init-from a1 --seed 0"
    (tmp_path / "runs").mkdir()
    for cwd in (tmp_path, tmp_path / "runs", Path("/")):
        monkeypatch.chdir(cwd)
        assert train_command(tc, Path("ignored")) == expected
    shipped = {**tc, "init_from": "testbed-a"}
    assert "--out a2 --init-from testbed-a " in train_command(shipped, Path("ignored"))
    assert shown_runs(["/x/runs/b", "/y/a"]) == ["x/runs/b", "y/a"]  # apart: from their common parent
    # an earlier stage's command, as eval.json kept it when first written
    stored = (f"python -m slimwise.testbed.train --backbone a --out {tc['out']} --init-from {tc['init_from']}"
              " --seed 0")
    assert shown_command(stored) == expected


def test_evaluate_command_writes_the_card_of_a_no_eval_run(tmp_path, capsys):
    """`python -m lab.testbed.evaluate evaluate RUN --dtype float32` turns a `--no-eval` run into a
    carded model (eval.json and README.md, evaluated in the dtype asked); a directory that is no finished run
    gets one line and exit 2, and nothing is written."""
    from lab.testbed.evaluate import main as card_main

    bad = tmp_path / "empty"
    bad.mkdir()
    assert card_main(["evaluate", str(bad)]) == 2
    assert "no train_config.json" in capsys.readouterr().err and not any(bad.iterdir())
    cfg = tiny_config(tmp_path, "c", max_steps=2, eval_n_per_family=1, heldout_n_per_family=1, row_groups=4,
                      packing="packed", seq_len=192, optimizer="muon")
    out = train(cfg)
    assert not (out / "eval.json").exists()
    assert json.loads((out / "train_summary.json").read_text())["packing"] == "packed"
    assert card_main(["evaluate", str(out), "--dtype", "float32"]) == 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["test"]["dtype"] == "float32" and ev["test"]["n"] == len(FAMILIES) \
        and ev["heldout"]["n"] == len(FAMILIES)
    card = (out / "README.md").read_text()
    assert "--row-groups 4 --packing packed --seq-len 192 --lr 0.003 --warmup-steps 2 --optimizer muon" \
        in card and "| qa |" in card
    assert "- optimiser: Muon (momentum 0.95" in card
    # how a hybrid was packed
    assert "segment-aware versions that start every sample from a zero state" in card
    assert "arithmetic" in capsys.readouterr().out


def test_killing_the_training_command_stops_its_ranks(tmp_path):
    """kill -9 of a `--ranks 2` training command started as a shell's background job (`cmd &`, nohup: SIGINT
    ignored, so torch's own parent-death signal, SIGINT, does nothing): its rank processes end too (SlimWise's
    parent-death signal is SIGTERM), rather than train on, orphaned, writing the run directory."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    overrides = [a for k, v in TINY["c"].items() for a in ("--override", f"{k}={json.dumps(v)}")]
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lab.testbed.train", "--backbone", "c",
                             "--out", str(out), "--minutes", "20", "--ranks", "2",
                             "--no-eval", "--no-progress", *overrides],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300  # imports and the tokenizer in 3 processes: about 15 s when idle
        while not ((out / "train_log.jsonl").is_file() and (out / "train_log.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, f"ranks left running after the training command died: {alive}"
    finally:
        for p in [*children, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()


def test_continued_training_with_long_families_starts_from_the_model_and_cards_them(tmp_path, tok, capsys):
    """`--init-from MODEL --override max_position_embeddings=1152 --family-weights lookup=1,chain=1`: the run
    starts from MODEL's weights and tokenizer with the longer context, draws the weighted long families at
    lengths up to --long-max-length (half of them in the top octave: --long-top-share 0.5; and no other long
    family), and its card evaluates them at every swept length, states the draw and lists the run it continued
    (kept once that run is deleted). A model of another backbone or an unknown family is refused before
    anything is written."""
    from transformers import AutoModelForCausalLM

    from lab.testbed.evaluate import main as card_main
    from lab.testbed.train import step_samples
    from slimwise.errors import SlimWiseError
    from slimwise.testbed.long_tasks import LENGTHS, MIN_LENGTH

    source = train(tiny_config(tmp_path / "src", max_steps=2))
    cfg = tiny_config(tmp_path, max_steps=2, init_from=str(source), family_weights={"lookup": 1, "chain": 2},
                      model_overrides={"max_position_embeddings": 1152}, long_max_length=200, seq_len=256,
                      long_top_share=0.5, eval_n_per_family=1, heldout_n_per_family=0)
    drawn = step_samples(cfg, 0)
    long = [s for s in drawn if s.domain == "long"]
    assert sorted(s.family for s in long) == ["chain", "chain", "lookup"]
    assert all(MIN_LENGTH - 10 <= len(s.prompt) <= 200 for s in long)
    assert {s.family for s in drawn} - {"lookup", "chain"} == set(FAMILIES)
    assert [s.prompt for s in long] == [s.prompt for s in step_samples(cfg, 0) if s.domain == "long"]
    start = build_model(cfg, tok)
    assert start.config.max_position_embeddings == 1152
    src_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    for (name, p), q in zip(start.state_dict().items(), src_model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    out = train(cfg)
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert card_main(["evaluate", str(out), "--dtype", "float32"]) == 0
    ev = json.loads((out / "eval.json").read_text())
    assert list(ev["long"]["lengths"]) == [str(n) for n in LENGTHS]
    top = ev["long"]["lengths"][str(LENGTHS[-1])]
    assert set(top["families"]) == {"lookup", "chain", "infer"} and top["max_prompt_tokens"] <= LENGTHS[-1]
    card = (out / "README.md").read_text()
    assert card.startswith("# testbed-a-long:") and "### Long prompts" in card
    # run directories as the card prints them: relative to the directory holding both runs (tmp_path)
    assert f"--init-from src/{source.name} --override max_position_embeddings=1152" in card
    assert "--long-max-length 200 --long-top-share 0.5" in card
    assert "log-uniformly from 48 to 200 characters, 50% of them uniformly from 100 to 200 instead" in card
    assert "Long-prompt bar of the issue: >= 80% at the longest length (1,024 characters" in card
    # the run it continued is a stage of its card, kept in eval.json: the card keeps it once that run is gone
    assert f"It is `{source.name}` (itself trained from scratch) continued" in card
    assert "- the last of 2 stages, each run's `--init-from` the one before" in card
    # both runs ran lab.testbed.train, which their train_summary.json records; cards of the shipped backbones,
    # trained before it moved, keep slimwise.testbed.train (their summaries name no entry)
    assert "- command: `python -m lab.testbed.train --backbone a " in card
    stage = next(line for line in card.splitlines() if line.startswith("  1. `"))
    assert stage.startswith(f"  1. `python -m lab.testbed.train --backbone a --out {source.name} "
                            "--override")
    assert "--max-steps 2 --seed 0" in stage and "--warmup-steps 2" in stage and "`: steps 2, tokens" in stage
    stages = json.loads((out / "eval.json").read_text())["earlier_stages"]
    assert [st["out"] for st in stages] == [str(source)]
    capsys.readouterr()
    with pytest.raises(SlimWiseError, match="is a qwen3_moe model; backbone c is qwen3_5_moe_text"):
        train(tiny_config(tmp_path / "wrong", "c", init_from=str(source)))
    with pytest.raises(SlimWiseError, match=r"unknown families \['lookups'\]"):
        train(tiny_config(tmp_path / "typo", family_weights={"lookups": 1}))
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "typo").exists()
    shutil.rmtree(source)
    assert card_main(["card", str(out)]) == 0
    assert (out / "README.md").read_text() == card
