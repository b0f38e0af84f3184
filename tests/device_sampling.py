"""Token selection on a GPU backend's device against the host sampler (core/sample.cpp, as lily._core.Sampler): the
configurations and the check shared by tests/metal/test_metal_sample.py (the Metal kernel in the CPU harness) and
tests/test_cuda.py (the CUDA kernel).

The model's decode loop runs with device selection (Generator.on_device: the kernel picks each token, records it in
the penalty state and advances the draw counter). A second session of the same model then replays the chosen tokens
to recover the logits each selection saw, and a host Sampler given the same prompt and history must choose the same
token at every step (same rules, same counter-based draw), with the same logprob. The history (ids already in the
session before the prompt, which count for the penalties) is the prompt's most likely next tokens, so that a penalty
the kernel got wrong changes the choice. The vocabulary (4096, of which the first N_VALID may be chosen) is larger
than the kernels' 1024 threads, so each thread scans several ids and the top-k radix selection and the ordered
compaction run as at the real vocabulary."""
import numpy as np

import lily

VOCAB = 4096
N_VALID = 4000  # not a multiple of the kernels' 1024 threads
PROMPT_LEN = 6
HISTORY_LEN = 16
STEPS = 6
# name: sampling parameters
CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0, top_k=1024),  # the most candidates the kernel holds
    "top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.6),
    "min_p_penalties": dict(temperature=1.2, top_k=200, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.3,
                            frequency_penalty=0.4),
    # A negative frequency penalty rewards repeats (greedy: net +9 after one use, which the tiny model's logits never
    # overcome), so generated tokens come back and the counts the kernel keeps decide later choices.
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=-10.0),
    "top_k_penalties": dict(temperature=0.7, top_k=8, repetition_penalty=1.5, presence_penalty=1.0,
                            frequency_penalty=-4.0),
}


def check_device_selection(core, model, name: str, seed: int, selected=None, vocab=VOCAB, n_valid=N_VALID) -> None:
    """CONFIGS[name] with `seed` on `model` (a lily._core.Model whose lm_head has `vocab` rows, the first `n_valid`
    of them choosable): the device's tokens and logprobs against the host sampler's. selected(), if given, counts
    the selection kernel's launches so far."""
    rng = np.random.default_rng(seed)
    params = dict(CONFIGS[name], seed=seed)  # all 64 bits of the draw's seed in play
    prompt = rng.integers(0, n_valid, PROMPT_LEN).astype(np.int32)
    likely = model.session(max_context=64).prefill(prompt)
    history = np.argsort(-likely[:n_valid], kind="stable")[:HISTORY_LEN].astype(np.int32)
    print(f"params {params}, prompt {prompt.tolist()}, history {history.tolist()}")
    replay = model.session(max_context=64)
    replay.prefill(history)
    logits = replay.prefill(prompt)

    session = model.session(max_context=64)
    session.prefill(history)  # already in the session: they count for the penalties
    gen = core.Generator(session, core.SamplingParams(**params), [], STEPS, n_valid)
    assert gen.on_device, f"{name}: the backend should select these tokens on the device"
    gen.prefill(prompt)
    before = selected() if selected else 0
    steps = [gen.next()[:2] for _ in range(STEPS)]  # (token, logprob)
    if selected:
        assert selected() - before >= STEPS - 1, "the sample kernel did not pick the tokens"

    host = lily._core.Sampler(lily._core.SamplingParams(**params), vocab, n_valid)
    host.add_prompt(history.tolist() + prompt.tolist())
    for i, (token, logprob) in enumerate(steps):
        want = host.sample(logits)
        p = host.probs(logits)
        assert token == want.token, (f"{name}, step {i}: device chose {token} (host probability {p[token]:.4g}), "
                                     f"host chose {want.token} (probability {p[want.token]:.4g})")
        assert abs(logprob - want.logprob) < 1e-4, f"{name}, step {i}: logprob {logprob} != host {want.logprob}"
        host.accept(token)
        if i + 1 < STEPS:
            logits = replay.prefill(np.array([token], np.int32))
