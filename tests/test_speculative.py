"""Speculative, parallel and early-exit decoding (course_lib.speculative, notebook 15): exactness against
greedy decoding, the sampled distribution against the target's, the paged cache's rollback, bad inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

import course_lib
from course_lib.decode.cache import PagedKVCache
from course_lib.decode.graphs import DecodeGraphs, StepGraphs, step_key
from course_lib.decode.toy_model import ToyModel
from course_lib.models import Llama, LlamaConfig
from course_lib.models.generate import greedy_reference
from course_lib.models.llama import rope_torch
from course_lib.speculative import (
    LayerDraft,
    ModelDraft,
    NGramDraft,
    accept_sampled,
    alpha_for_tokens,
    cost_model_speedup,
    drafts,
    early_exit_generate,
    engine,
    expected_batch_time,
    expected_tokens,
    expected_tokens_of_rounds,
    forward_tokens,
    jacobi,
    jacobi_generate,
    jacobi_update,
    lookahead_generate,
    measured_cost_speedup,
    plain_generate,
    predicted_speedup,
    speculative_generate,
    steps,
    still_running,
    truncate,
)
from course_lib.speculative.steps import TorchPagedKV, kept_pages, padded_step

DEV = course_lib.DEVICE  # the toy models live where the kernels run (the kernel-path tests call them)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 5, 6], [30, 3]]  # repeats for n-gram lookup


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def toy():
    model = ToyModel(DEV)
    return model, [model.generate_full(p, 12) for p in PROMPTS]


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=128
    )
    model = Llama(config)
    model.reset_parameters(std=0.1)
    return model


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at about 0.999 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---------------------------------------------------------------- greedy: exactly the target's tokens
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_ngram_draft_matches_greedy(toy, gamma):
    model, expected = toy
    r = speculative_generate(model, NGramDraft(), PROMPTS, 12, gamma=gamma, attention="torch")
    assert r.tokens == expected, f"gamma={gamma}: {r.tokens} != {expected}"
    assert all(sum(a + 1 for _, a in rounds) == 12 for rounds in r.rounds)


@pytest.mark.parametrize("gamma", [3])
def test_greedy_model_draft_matches_greedy_with_different_acceptances(toy, gamma):
    model, expected = toy
    draft = ToyModel(DEV, seed=8)
    r = speculative_generate(model, draft, PROMPTS, 12, gamma=gamma, attention="torch")
    assert r.tokens == expected, f"gamma={gamma}"
    # a draft that is the target itself: every draft kept, gamma + 1 tokens a round
    r = speculative_generate(
        model, ModelDraft(model, attention="torch"), PROMPTS, 12, gamma=gamma, attention="torch"
    )
    assert r.tokens == expected
    assert r.rounds[0][0] == (gamma, gamma) and r.target_steps == math.ceil(12 / (gamma + 1))


def test_batch_with_different_acceptance_lengths_through_the_kernel(toy):
    model, expected = toy
    draft = ToyModel(DEV)  # the target with a perturbed head: agrees often, not always
    noise = torch.randn(draft.head.shape, generator=torch.Generator().manual_seed(0)).to(draft.head)
    draft.head = draft.head + 0.05 * noise
    r = speculative_generate(model, ModelDraft(draft, 16, 8), PROMPTS[:2], 8, gamma=3, attention="kernel")
    assert r.tokens == [e[:8] for e in expected[:2]]
    accepted = [[a for _, a in rounds] for rounds in r.rounds]
    assert accepted[0] != accepted[1], accepted  # the sequences kept different numbers of drafts


def test_llama_with_a_smaller_draft_matches_greedy_reference(llama):
    torch.manual_seed(1)
    draft = Llama(LlamaConfig(**{**llama.config.as_dict(), "n_layers": 1}))
    prompt = [3, 4, 5, 6, 3, 4]
    expected = greedy_reference(llama, prompt, 10)
    for gamma in (1, 3):
        r = speculative_generate(llama, draft, [prompt, prompt[:3]], 10, gamma=gamma, attention="torch")
        assert r.tokens[0] == expected, f"gamma={gamma}"
        assert r.tokens[1] == greedy_reference(llama, prompt[:3], 10)


# ---------------------------------------------------------------- sampling: the target's distribution
def test_rejection_rule_keeps_the_target_distribution():
    """Two tokens drawn by the rule, with the target's and the draft's second distribution depending on
    the first token: their joint frequencies match p0(y0) p1(y1 | y0) (chi-square), whatever q."""
    V, N = 4, 6000
    g = torch.Generator().manual_seed(0)
    p0, q0 = torch.rand(V, generator=g).softmax(0), torch.rand(V, generator=g).mul(3).softmax(0)
    p1, q1 = (torch.rand(V, V, generator=g).mul(3).softmax(-1) for _ in range(2))
    p2 = torch.full((V, V), 1.0 / V)  # after two drafts: not looked at
    counts = torch.zeros(V, V)
    for _ in range(N):
        x0 = int(torch.multinomial(q0, 1, generator=g))
        x1 = int(torch.multinomial(q1[x0], 1, generator=g))
        n, token = accept_sampled(torch.stack([p0, p1[x0], p2[x1]]), torch.stack([q0, q1[x0]]), [x0, x1], g)
        if (
            n == 0
        ):  # y0 = the resampled token; y1 from a next round: draft x from q1[y0], verify against p1[y0]
            y0 = token
            x = int(torch.multinomial(q1[y0], 1, generator=g))
            kept, t = accept_sampled(torch.stack([p1[y0], p2[x]]), q1[y0][None], [x], g)
            y1 = x if kept else t
        else:
            y0, y1 = x0, (x1 if n == 2 else token)
        counts[y0, y1] += 1
    expected = N * p0[:, None] * p1
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(V * V - 1), f"chi-square {chi2:.1f} over {V * V - 1} degrees of freedom"


class Markov:
    """A model of the serving interface whose next-token logits depend on the last token only (a table):
    exact probabilities of any continuation are products of table rows."""

    num_layers, num_kv_heads, head_dim, dtype, device = 1, 1, 16, torch.float32, torch.device("cpu")

    def __init__(self, vocab: int, seed: int, sharpness: float):
        self.vocab_size = vocab
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * sharpness

    def forward_step(self, token_ids, positions, kv):
        return self.table[token_ids]


@pytest.mark.parametrize("kind", ["model", "n-gram"])
def test_sampled_speculative_generation_matches_the_target_distribution(kind):
    """Three tokens after [0, 1, 0] from 600 copies of one prompt, against the exact distribution; the
    n-gram draft proposes what followed the last token earlier (a one-hot q)."""
    V, B, T = 3, 600, 1.3
    target = Markov(V, 0, 1.5)
    draft = ModelDraft(Markov(V, 1, 1.5), num_pages=2 * B) if kind == "model" else NGramDraft()
    r = speculative_generate(
        target, draft, [[0, 1, 0]] * B, 3, gamma=2, temperature=T,
        generator=torch.Generator().manual_seed(0), page_size=4, attention="torch",
    )  # fmt: skip
    assert 0 < r.acceptance_rate < 1
    p = torch.softmax(target.table.double() / T, -1)
    expected = (
        p[0][:, None, None] * p[:, :, None] * p[None, :, :]
    ).flatten() * B  # p(y0|0) p(y1|y0) p(y2|y1)
    counts = torch.zeros(V**3, dtype=torch.float64)
    for y0, y1, y2 in r.tokens:
        counts[(y0 * V + y1) * V + y2] += 1
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(V**3 - 1), f"chi-square {chi2:.1f}"


# ---------------------------------------------------------------- the paged cache's rollback
def test_truncate_releases_pages_and_respects_shared_ones():
    cache = PagedKVCache(1, 8, 4, 1, 16, torch.float32, "cpu")
    cache.add_sequence(0)
    cache.append(0, 10)  # 3 pages
    pages0 = list(cache.seqs[0].pages)
    cache.fork(0, 1)
    free = cache.allocator.num_free
    assert truncate(cache, 1, 5) == 1  # one reference released; the page stays with sequence 0
    assert cache.seqs[1].length == 5 and cache.seqs[1].pages == pages0[:2]
    assert cache.allocator.num_free == free and cache.allocator.refs[pages0[2]] == 1
    cache.append(1, 1)  # writing into the shared, partly filled page copies it first
    assert cache.seqs[1].pages[1] != pages0[1] and cache.allocator.refs[pages0[1]] == 1
    # sequence 0 keeps one page: pages0[1] (its own since the copy) and pages0[2] return to the pool
    assert truncate(cache, 0, 4) == 2 and cache.allocator.num_free == free + 1  # (the copy took one)
    assert cache.allocator.refs[pages0[0]] == 2 and cache.allocator.refs[pages0[2]] == 0
    assert truncate(cache, 0, 0) == 1 and cache.seqs[0].pages == [] and cache.allocator.refs[pages0[0]] == 1
    with pytest.raises(ValueError, match="more than"):
        truncate(cache, 1, 7)


def test_rolled_back_sequence_decodes_as_if_never_extended(toy):
    model, expected = toy
    cache = PagedKVCache(
        model.num_layers, 16, 4, model.num_kv_heads, model.head_dim, model.dtype, model.device
    )
    cache.add_sequence(0)
    prompt = PROMPTS[1]
    forward_tokens(model, cache, [(0, prompt + [9, 9, 9, 9, 9])], attention="torch")  # 5 wrong drafts
    truncate(cache, 0, len(prompt))
    assert cache.seqs[0].pages == cache.seqs[0].pages[: math.ceil(len(prompt) / 4)]
    (rows,) = forward_tokens(model, cache, [(0, [expected[1][0]])], attention="torch")
    assert int(rows[-1].argmax()) == expected[1][1]


# ---------------------------------------------------------------- bad inputs, refused by name
def test_bad_inputs_are_refused(toy, llama):
    model, _ = toy
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, NGramDraft(), PROMPTS, 4, gamma=0)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, NGramDraft(), PROMPTS, 4, gamma=2.5)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(model, llama, PROMPTS, 4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(model, NGramDraft(), PROMPTS, 4, temperature=-0.5)
    for threshold in (0, 1.5, -1):
        with pytest.raises(ValueError, match="threshold"):
            early_exit_generate(llama, [1, 2], 3, threshold)
    with pytest.raises(ValueError, match="exit_layers"):
        early_exit_generate(llama, [1, 2], 3, 0.5, exit_layers=[4])


def test_expected_tokens_and_speedup_formulas():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)


def test_measured_cost_model_is_the_textbook_formula_at_its_assumptions():
    """t_verify = t_step, t_draft = gamma c t_step, no rollback: the textbook speed-up; dearer parts lower it."""
    t_step = 0.02
    for alpha, gamma, c in ((0.8, 4, 0.05), (0.5, 1, 0.3), (0.0, 3, 0.0), (1.0, 2, 0.1)):
        textbook = predicted_speedup(alpha, gamma, c)
        got = measured_cost_speedup(alpha, gamma, t_step, t_draft=gamma * c * t_step, t_verify=t_step)
        assert got == pytest.approx(textbook, rel=1e-12), (alpha, gamma, c)
        tokens = expected_tokens(alpha, gamma)
        assert cost_model_speedup(tokens, t_step, gamma * c * t_step, t_step, 0.0) == pytest.approx(textbook)
    got = measured_cost_speedup(0.8, 4, t_step, 0.2 * t_step, 1.5 * t_step, 0.1 * t_step)
    assert got == pytest.approx(expected_tokens(0.8, 4) / (0.2 + 1.5 + 0.1))
    with pytest.raises(ValueError, match="t_verify"):
        cost_model_speedup(2.0, t_step, 0.0, 0.0)


def test_expected_tokens_of_rounds_and_the_alpha_a_speedup_needs():
    assert expected_tokens_of_rounds(0.7, [4, 4, 4]) == pytest.approx(expected_tokens(0.7, 4))
    assert expected_tokens_of_rounds(0.7, [0, 2]) == pytest.approx((1 + expected_tokens(0.7, 2)) / 2)
    for alpha, gamma in ((0.3, 2), (0.8, 4), (0.95, 6)):
        assert alpha_for_tokens(expected_tokens(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-9)
    assert alpha_for_tokens(0.9, 3) == 0.0 and alpha_for_tokens(4.5, 3) is None


def test_a_batch_runs_until_its_slowest_sequence():
    """`still_running` and `expected_batch_time` against their limits and a simulation of the rounds."""
    assert still_running(1.0, [2], 10) == [1.0] * 4  # 3 tokens a round: ceil(10 / 3) rounds
    assert still_running(0.0, [4], 7) == [1.0] * 7  # one token a round
    rounds = expected_batch_time(0.6, [3], 300, 1, lambda a: 1.0)
    assert rounds == pytest.approx(300 / expected_tokens(0.6, 3), rel=0.02)  # the last round truncated
    rng = random.Random(0)

    def rounds_of_one(alpha, gamma, tokens):
        n = r = 0
        while n < tokens:
            k = 1
            while k <= gamma and rng.random() < alpha:
                k += 1
            n, r = n + k, r + 1
        return r

    for alpha, gamma, proposed, tokens, batch in ((0.5, 2, [2], 40, 4), (0.8, 4, [4], 64, 8)):
        trials = [[rounds_of_one(alpha, gamma, tokens) for _ in range(batch)] for _ in range(4000)]
        # time of a round with a active sequences: 1 + a (so the active count matters, not only the last)
        simulated = sum(sum(1 + sum(r > k for r in t) for k in range(max(t))) for t in trials) / len(trials)
        predicted = expected_batch_time(alpha, proposed, tokens, batch, lambda a: 1.0 + a)
        assert predicted == pytest.approx(simulated, rel=0.02)
        one = expected_batch_time(alpha, proposed, tokens, 1, lambda a, b=batch: 1.0 + b)
        assert predicted > one  # E[the slowest of the batch's rounds] > E[one sequence's rounds]
    with pytest.raises(ValueError, match="tokens"):
        still_running(0.5, [2], 0)
    with pytest.raises(ValueError, match="no rounds"):
        still_running(0.5, [], 10)


# ---------------------------------------------------------------- Jacobi and lookahead decoding
def test_jacobi_update():
    assert jacobi_update([7, 1, 2, 3], [1, 2, 5, 6]) == ([1, 2, 5], [6, 6, 6])
    assert jacobi_update([7, 4, 4], [1, 2, 3]) == ([1], [2, 3])
    assert jacobi_update([7, 1, 2], [1, 2, 3]) == ([1, 2, 3], [3, 3])


def test_jacobi_and_lookahead_match_greedy(toy):
    model, expected = toy
    for n in (1, 4):
        j = jacobi_generate(model, PROMPTS[0], 12, n=n, attention="torch")
        assert j.tokens == expected[0] and j.steps <= 12, f"Jacobi n={n}"
    look = lookahead_generate(model, PROMPTS[1], 12, n=3, ngram=3, candidates=3, attention="torch")
    assert look.tokens == expected[1]
    assert len(look.branches) == look.steps and all(0 <= b <= 3 for b in look.branches), look.branches
    look = lookahead_generate(model, PROMPTS[0], 6, n=2, ngram=3, candidates=2, attention="kernel")
    assert look.tokens == expected[0][:6]


# ---------------------------------------------------------------- early exit and self-speculation
def test_early_exit(llama):
    prompt = [3, 4, 5, 6, 3, 4]
    greedy = greedy_reference(llama, prompt, 8)
    full = early_exit_generate(llama, prompt, 8, threshold=1.0, attention="torch")
    assert full.tokens == greedy and full.layers == [4] * 8
    # every new token leaves after layer 2: the first 2 layers decide all but the prefill's token
    k = 2
    out = early_exit_generate(llama, prompt, 8, 1e-9, exit_layers=[k], attention="torch", keep_cache=True)
    assert out.layers == [4] + [k] * 7
    shallow = plain_generate(LayerDraft(llama, k), [prompt + out.tokens[:1]], 7, attention="torch").tokens[0]
    assert out.tokens[1:] == shallow
    # the skipped layers' K/V of those tokens: the layer-k hidden state through their norm and W_k (CALM)
    seq = prompt + out.tokens[:-1]
    x = llama.tok_embeddings(torch.tensor([seq]))
    cos, sin = llama.rope_cos[: len(seq)], llama.rope_sin[: len(seq)]
    with torch.no_grad():
        for layer in llama.layers[:k]:
            x = layer(x, cos, sin)
        cache, pages = out.cache, out.cache.seqs[0].pages
        slots = [pages[i // cache.page_size] * cache.page_size + i % cache.page_size for i in range(len(seq))]
        for j in range(k, 4):
            layer = llama.layers[j]
            kk = layer.attention.wk(layer.attention_norm(x[0])).view(len(seq), 2, -1)
            kk, _ = rope_torch(kk, kk, cos[:, None], sin[:, None])
            stored = cache.k_pages[j].flatten(0, 1)[slots]
            torch.testing.assert_close(stored[len(prompt) :], kk[len(prompt) :], atol=1e-4, rtol=1e-4)


def test_self_speculative_matches_greedy(llama):
    prompt = [3, 4, 5, 6, 3, 4]
    greedy = greedy_reference(llama, prompt, 10)
    for gamma in (1, 3):
        r = speculative_generate(llama, LayerDraft(llama, 2), [prompt], 10, gamma=gamma, attention="torch")
        assert r.tokens[0] == greedy, f"gamma={gamma}"


# ---------------------------------------------------------------- steps replayed as CUDA graphs
def test_cuda_graphs_are_refused_on_a_cpu_model():
    model = ToyModel("cpu")
    calls = {
        "plain_generate": lambda: plain_generate(model, PROMPTS, 4, cuda_graphs=True),
        "speculative_generate": lambda: speculative_generate(
            model, NGramDraft(), PROMPTS, 4, cuda_graphs=True
        ),
        "jacobi_generate": lambda: jacobi_generate(model, PROMPTS[0], 4, cuda_graphs=True),
        "lookahead_generate": lambda: lookahead_generate(model, PROMPTS[0], 4, cuda_graphs=True),
        "ModelDraft": lambda: ModelDraft(model, cuda_graphs=True),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=f"{where}: cuda_graphs=True .* need a model on a CUDA device"):
            call()
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        plain_generate(model, PROMPTS, 4, cuda_graphs="yes")
    with pytest.raises(ValueError, match="StepGraphs: CUDA graphs need a model on a CUDA device"):
        StepGraphs(model, PagedKVCache(2, 4, 4, 2, 16, torch.float32, "cpu"))
    assert not hasattr(model, steps.KEPT)  # nothing was kept for the refused calls


def test_graph_keys_and_the_padding_of_ragged_steps():
    cache = PagedKVCache(1, 16, 4, 1, 16, torch.float32, "cpu")
    for s, n in ((0, 3), (1, 9), (2, 17)):  # 1, 3 and 5 pages
        cache.add_sequence(s)
        cache.append(s, n)
    assert step_key(cache, [0, 1, 2], 4) == (3, 4, 8) and step_key(cache, [1, 0], 1) == (2, 1, 4)
    assert step_key(cache, [0], 1) == (1, 1, 1)
    assert StepGraphs.key(None, (3, 4, 8)) == (3, 4, 8)  # keyed by (B, T, width)
    assert DecodeGraphs.key(None, (3, 1, 8)) == (3, 8)  # notebook 10's keys: (B, width), T = 1
    with pytest.raises(ValueError, match="one token per sequence"):
        DecodeGraphs.key(None, (3, 2, 8))
    # three sequences bringing 2, 1, 3 tokens, padded to 3 each by their last token at its position
    ids, pos, keep = padded_step([(0, [5, 6]), (1, [7]), (2, [8, 9, 10])], [3, 9, 17], 3)
    assert ids == [5, 6, 6, 7, 7, 7, 8, 9, 10] and pos == [3, 4, 4, 9, 9, 9, 17, 18, 19]
    assert keep == [0, 1, 3, 6, 7, 8]
    assert padded_step([(4, [1, 2])], [0], 2) == ([1, 2], [0, 1], [0, 1])
    assert [kept_pages(n) for n in (1, 2, 3, 14, 16, 17)] == [1, 2, 4, 16, 16, 32]


class EagerStepGraphs:
    """`StepGraphs`' contract without a GPU: each step of B sequences x T tokens runs as it is, in the
    uniform layout a graph replays (`TorchPagedKV`, no padding rows), and is counted under its key."""

    def __init__(self, model, cache, max_tokens: int = 64):
        self.model, self.cache, self.max_tokens, self.graphs, self.replays = model, cache, max_tokens, {}, 0

    def step(self, seq_ids, tokens, positions, slots):
        B, T = len(seq_ids), len(tokens) // len(seq_ids)
        assert B * T == len(tokens) == len(positions) == len(slots)
        key = step_key(self.cache, seq_ids, T)
        self.graphs[key] = self.graphs.get(key, 0) + 1
        self.replays += 1
        kv = TorchPagedKV.for_step(self.cache, seq_ids, [T] * B, slots)
        ids, pos = (torch.tensor(x, device=self.model.device) for x in (tokens, positions))
        return self.model.forward_step(ids, pos, kv)


def generations(model, draft, own) -> dict:
    """name -> (run(cuda_graphs) -> the new tokens of each prompt it decodes, those prompts' indices):
    plain, speculative with ragged verification steps (n-gram), a bare draft model, a ModelDraft with
    its own graphs (`own`; eager: a fresh one), Jacobi and lookahead."""
    spec = lambda g, d, gamma: speculative_generate(model, d, PROMPTS, 12, gamma=gamma, cuda_graphs=g).tokens
    look = lambda g: lookahead_generate(model, PROMPTS[1], 12, n=3, ngram=3, candidates=3, cuda_graphs=g)
    return {
        "plain": (lambda g: plain_generate(model, PROMPTS, 12, cuda_graphs=g).tokens, [0, 1, 2]),
        "n-gram": (lambda g: spec(g, NGramDraft(), 3), [0, 1, 2]),
        "draft model": (lambda g: spec(g, draft, 3), [0, 1, 2]),
        "ModelDraft": (lambda g: spec(g, own if g else ModelDraft(draft, 64, 16), 2), [0, 1, 2]),
        "jacobi": (lambda g: [jacobi_generate(model, PROMPTS[0], 12, n=4, cuda_graphs=g).tokens], [0]),
        "lookahead": (lambda g: [look(g).tokens], [1]),
    }


def kept_graphs(*models) -> list:
    """The caches (with their graphs) that cuda_graphs=True kept on these models (`steps.step_cache`)."""
    return [k for m in models for k in getattr(m, steps.KEPT)]


def test_graphed_path_pads_rolls_back_and_keeps_its_graphs(monkeypatch):
    """The bookkeeping of cuda_graphs=True, checkable without a GPU: StepGraphs replaced by a stand-in
    that runs each uniform step as it is. Ragged steps are padded (the n-gram draft proposes different
    counts; prompts of different lengths) and the pads rolled back: greedy's tokens; the caches and their
    graphs kept on the model, empty after each call; a second identical call meets no new step shape."""
    for module in (steps, drafts):
        monkeypatch.setattr(module, "StepGraphs", EagerStepGraphs)
    for module in (engine, jacobi, drafts):
        monkeypatch.setattr(module, "check_graphs", lambda where, model, attention, cuda_graphs: cuda_graphs)
    pads, padded = [], steps.padded_step
    count = lambda live, a, n: pads.append(sum(n - len(t) for _, t in live)) or padded(live, a, n)
    monkeypatch.setattr(steps, "padded_step", count)
    model, draft = ToyModel(DEV), ToyModel(DEV, seed=8)
    expected = [model.generate_full(p, 12) for p in PROMPTS]
    own = ModelDraft(draft, 64, 16, cuda_graphs=True)
    runs = generations(model, draft, own)
    for name, (run, which) in runs.items():
        assert run(True) == [expected[i] for i in which], name
    assert max(pads) > 0, pads
    kept = kept_graphs(model, draft)
    assert all(not k.busy and not k.cache.seqs for k in kept)
    assert all(k.cache.allocator.num_free == k.cache.allocator.num_pages for k in kept)
    assert {4, 1} <= {T for k in kept for _, T, _ in k.graphs.graphs}  # gamma + 1 and decode steps
    assert own.graphs.replays > 0 and own.cache.seqs == {}
    shapes = [dict(k.graphs.graphs) for k in kept + [own]]
    for name, (run, which) in runs.items():  # again: every step shape was met the first time
        assert run(True) == [expected[i] for i in which], f"{name}, second run"
    assert kept_graphs(model, draft) == kept
    for k, before in zip(kept + [own], shapes):
        assert set(k.graphs.graphs) == set(before), "a second identical call met a new step shape"
        assert all(k.graphs.graphs[key] > n for key, n in before.items())


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_tokens_of_eager_steps():
    """Every generation of `generations` gives the same tokens (greedy's) with cuda_graphs=True as without,
    and so does self-speculation (`LayerDraft` of a Llama); a second run captures no new graph."""
    model, draft = ToyModel(DEV), ToyModel(DEV, seed=8)
    expected = [model.generate_full(p, 12) for p in PROMPTS]
    own = ModelDraft(draft, 64, 16, cuda_graphs=True)
    runs = generations(model, draft, own)
    for name, (run, which) in runs.items():
        assert run(False) == [expected[i] for i in which], f"{name}, eager"
        assert run(True) == [expected[i] for i in which], f"{name}, CUDA graphs"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=128
    )
    llama = Llama(config).to(DEV)
    llama.reset_parameters(std=0.1)
    layers, prompts = LayerDraft(llama, 2), [[3, 4, 5, 6, 3, 4], [7, 8, 9]]
    selfspec = lambda g: speculative_generate(llama, layers, prompts, 10, gamma=3, cuda_graphs=g).tokens
    assert selfspec(True) == selfspec(False) == plain_generate(llama, prompts, 10).tokens
    kept = kept_graphs(model, draft, llama, layers) + [own]
    assert {4, 1} <= {T for k in kept for _, T, _ in k.graphs.graphs}
    captured = [set(k.graphs.graphs) for k in kept]
    for name, (run, which) in runs.items():
        assert run(True) == [expected[i] for i in which], f"{name}, CUDA graphs, second run"
    assert selfspec(True) == selfspec(False)
    assert [set(k.graphs.graphs) for k in kept] == captured, "a second run captured a new step shape"
    assert own.graphs.replays > 0 and sum(k.graphs.replays for k in kept) > 100
    with pytest.raises(ValueError, match="attention must be 'kernel'"):
        plain_generate(model, PROMPTS, 4, attention="torch", cuda_graphs=True)
