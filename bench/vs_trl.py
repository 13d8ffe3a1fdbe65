"""grpolab vs TRL: the same GRPO step on the same tiny HF model, timed in one process.

    python bench/vs_trl.py [--steps N --group-size G --batch B --max-new-tokens L --arch llama]

Builds a randomly initialised tiny model with ``grpolab.rollout.tinyhf.make_tiny_model`` in a temporary
directory (nothing is downloaded), a local set of arithmetic prompts and one reward function,
then runs TRL's ``GRPOTrainer`` and grpolab's ``GRPOTrainer`` (``HFBackend``) with matched
settings:

* B completions per optimizer step (B / G prompts x G answers), one generation per step,
  one optimisation pass (``num_iterations=1`` / ``epochs=1``), no gradient accumulation;
* at most L new tokens, temperature 1, no top-k/top-p;
* the same beta (KL to a frozen reference), Adam(W, no weight decay) at a constant lr,
  gradient clipping at 1, dropout off, float32, no gradient checkpointing;
* per-reply mean loss (TRL ``loss_type='grpo'`` == grpolab ``seq_mean_token_mean``) and group
  std scaling with TRL's sample std + 1e-4 (grpolab ``std='sample', std_eps=1e-4``).

Each round times TRL then grpolab (``--rounds`` interleaved rounds); the first step of each
round is warm-up and not timed. A step is timed end to end (step end to step end): prompt
sampling, generation, rewards, reference and policy log-probs, backward, optimizer step and
each trainer's own bookkeeping (TRL also computes token entropies, as it always does). Model
loading and trainer construction are not timed. Wall-clock steps/s is the headline; steps per
CPU-second (process time) is printed too, as it is far less disturbed by other jobs on a shared
machine. ``--old-path`` adds grpolab with HF ``generate`` and one-pass scoring (the code before
the lean sampler), and ``--hf-forward`` grpolab with the lean sampler and shared-prompt scoring
over the HF model's forward (the code before ``grpolab.rollout.fastlm``), interleaved the same way.

Both trainers run in one process with the same torch thread count, 1 by default: on a small,
shared CPU, OpenMP threads that wait for each other make tiny-model steps many times slower.

After the timed rounds, one more step of each trainer runs under
``torch.utils.flop_counter.FlopCounterMode`` to count the work it does (FLOPs of matrix
multiplications and attention; elementwise ops are not counted), and the machine's
matrix-multiplication rate is measured at the same thread count. Work / rate is a floor no
trainer can beat on this machine (attention is counted in full, masks ignored, for both); the table shows how far above its floor each one runs, and
the best ratio any trainer doing grpolab's work could reach against TRL's measured time.

Completions stop at EOS, so completion lengths differ by sampling; the table reports generated
tokens per step and the padded width (decode steps) for both. A random model almost never
samples EOS for every row of a batch, so both run L decode steps and score [B, prompt + L]
(forcing EOS off would need a logits processor that grpolab's scorer does not model).

The sampling section compares, on grpolab's built-in TinyGPT and on the tiny HF model, the
KV-cache sampler against a no-cache sampler (the whole prefix recomputed for each token) and
against the forward-only bound: one teacher-forced forward over the same B x (prompt + L)
tokens, which sampling L tokens one at a time cannot beat.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from grpolab.config import Config, resolve
from grpolab.rollout.fastlm import pos_ids
from grpolab.rollout.hf import HFBackend
from grpolab.rollout.models import load_model
from grpolab.rollout.tinyhf import make_tiny_model
from grpolab.run.trainer import GRPOTrainer as LabTrainer

# transformers, datasets and trl are imported lazily, after main() has set these.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

# ----------------------------------------------------------------------------- task


PREAMBLE = ("You are a careful assistant. Think about the problem step by step, check every "
            "carry, and then write the final number after the words The answer is. ")


def make_rows(n: int, seed: int, preamble_words: int = 0) -> list[dict[str, str]]:
    """Arithmetic questions with their answers, generated here (no dataset download).

    ``preamble_words`` words of a fixed instruction go in front of every question (longer
    prompts, as with chat templates and system prompts).
    """
    words = (PREAMBLE * (1 + preamble_words // 20)).split()[:preamble_words]
    head = " ".join(words) + " " if words else ""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{head}What is {a} + {b}? The answer is", "answer": str(a + b)})
    return rows


def arithmetic_reward(prompts: list[Any], completions: list[Any], answer: list[str],
                      **_: Any) -> list[float]:
    """1 when the answer appears in the completion, else 0.1 x the share of digit characters.

    The shaping term keeps groups of a random model mixed, so the advantages are not all zero.
    One plain callable in TRL's reward convention, used by both trainers.
    """
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else str(c)
        if a in text:
            out.append(1.0)
        else:
            out.append(0.1 * sum(ch.isdigit() for ch in text) / max(1, len(text)))
    return out


# ----------------------------------------------------------------------------- trainers


def build_trl(args: argparse.Namespace, model_dir: str, rows: list[dict], out: str) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Clock(TrainerCallback):
        """Time at each optimizer-step end, and what that step generated."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[float] = []
            self.widths: list[float] = []
            self.trainer: Any = None

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append((time.perf_counter(), time.process_time()))
            m = self.trainer._metrics["train"]
            self.tokens.append(m["completions/mean_length"][-1] * args.batch)
            self.widths.append(m["completions/max_length"][-1])

    cfg = GRPOConfig(
        output_dir=out,
        num_generations=args.group_size,
        per_device_train_batch_size=args.batch,  # completions per device step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0, top_k=0, top_p=1.0,
        beta=args.beta,
        epsilon=0.2,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="grpo",
        scale_rewards="group",
        disable_dropout=True,
        gradient_checkpointing=False,
        bf16=False, fp16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=10**6,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_steps=args.warmup + args.steps,
        seed=args.seed,
        model_init_kwargs={"dtype": torch.float32},
    )
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.padding_side = "left"
    ds = Dataset.from_list(rows)
    clock = Clock()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[arithmetic_reward], args=cfg,
                          train_dataset=ds, processing_class=tok, callbacks=[clock])
    clock.trainer = trainer
    return trainer, clock


def run_trl_round(trainer: Any, clock: Any, args: argparse.Namespace) -> dict[str, float]:
    clock.times, clock.tokens, clock.widths = [], [], []
    trainer.args.max_steps = args.warmup + args.steps
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints a summary dict per train()
        trainer.train()
    w = args.warmup
    t = [b - a for a, b in zip(clock.times[w - 1], clock.times[-1])]
    return {"time": t[0], "cpu": t[1], "steps": args.steps, "tokens": sum(clock.tokens[w:]),
            "width": statistics.mean(clock.widths[w:])}


class CountingBackend(HFBackend):
    """HFBackend that notes what each rollout generated (for the tokens/step column)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.tokens: list[int] = []
        self.widths: list[int] = []

    def generate(self, prompts: list[Any], temperature: float, max_new_tokens: int,
                 generator: torch.Generator | None = None) -> Any:
        ro = super().generate(prompts, temperature, max_new_tokens, generator)
        if temperature > 0:  # rollouts, not greedy evaluation (there is none here)
            self.tokens.append(int(ro.completion_mask.sum()))
            self.widths.append(int(ro.completion_ids.shape[1]))
        return ro


def build_lab(args: argparse.Namespace, model_dir: str, rows: list[dict], out: str) -> Any:
    cfg = resolve(Config(
        out_dir=out, seed=args.seed, steps=10**6, budget=args.batch, group_size=args.group_size,
        temperature=1.0, max_new_tokens=args.max_new_tokens, lr=args.lr, grad_clip=1.0,
        epochs=1, beta=args.beta, eps_low=0.2, eps_high=0.2, loss_agg="seq_mean_token_mean",
        baseline="mean", scale="std", std="sample", std_eps=1e-4, eval_every=10**6,
        checkpoint_every=0, progress=False, model_path=model_dir, use_chat_template=False,
    ))
    model, tok = load_model(model_dir, device="cpu")
    backend = CountingBackend(model, tok, use_chat_template=False, reference=cfg.beta > 0,
                              seed=cfg.seed)
    return LabTrainer(cfg, backend, rows, [arithmetic_reward], heldout_rows=[], out_dir=out)


def run_lab_round(trainer: Any, args: argparse.Namespace) -> dict[str, float]:
    be = trainer.backend
    be.tokens, be.widths = [], []
    times = []
    for _ in range(args.warmup + args.steps):
        trainer.step()
        times.append((time.perf_counter(), time.process_time()))
    w = args.warmup
    t = [b - a for a, b in zip(times[w - 1], times[-1])]
    return {"time": t[0], "cpu": t[1], "steps": args.steps,
            "tokens": sum(be.tokens[w:]), "width": statistics.mean(be.widths[w:])}


# ----------------------------------------------------------------------------- sampling


def _sample(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def world_sampling(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """TinyGPT (TinyConfig defaults, random init): KV cache vs no cache vs forward bound."""
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(args.seed)
    model = TinyGPT(TinyConfig()).eval()
    backend = TinyBackend(model)
    prompts = [r["prompt"] for r in make_splits(args.seed, args.sample_batch, 0).train]
    prompt_ids, _ = backend.encode_prompts(prompts)
    b, tp = prompt_ids.shape
    n = model.config.max_len - tp

    def cached() -> int:
        ro = backend.generate(prompts, 1.0, n, torch.Generator().manual_seed(0))
        return b * ro.completion_ids.shape[1]

    def naive() -> int:
        gen = torch.Generator().manual_seed(0)
        ids = prompt_ids
        for _ in range(n):
            logits, _ = model(ids)
            ids = torch.cat([ids, _sample(logits[:, -1], gen)[:, None]], dim=1)
        return b * n

    full = torch.cat([prompt_ids, torch.randint(3, 17, (b, n))], dim=1)

    def bound() -> int:
        model(full[:, :-1])
        return b * n

    return _rates([("KV cache (TinyBackend.generate)", cached), ("no cache (naive)", naive),
                   ("forward-only bound", bound)], args.sample_repeats)


@torch.inference_mode()
def hf_sampling(args: argparse.Namespace, model_dir: str,
                rows: list[dict]) -> list[tuple[str, float, int]]:
    """The tiny HF model: HFBackend.generate vs no cache vs one teacher-forced forward."""
    model, tok = load_model(model_dir, device="cpu")
    backend = HFBackend(model, tok, use_chat_template=False, reference=False)
    prompts = [r["prompt"] for r in rows[: args.batch]]
    prompt_ids, prompt_mask = backend.encode_prompts(prompts)
    b = len(prompts)
    n = args.max_new_tokens

    def cached() -> int:
        ro = backend.generate(prompts, 1.0, n, torch.Generator().manual_seed(0))
        return b * ro.completion_ids.shape[1]

    def naive() -> int:
        gen = torch.Generator().manual_seed(0)
        ids, mask = prompt_ids, prompt_mask
        for _ in range(n):
            pos = pos_ids(mask)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                           logits_to_keep=1).logits
            ids = torch.cat([ids, _sample(logits[:, -1], gen)[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return b * n

    ids = torch.cat([prompt_ids, torch.randint(3, len(tok), (b, n))], dim=1)
    mask = torch.cat([prompt_mask, torch.ones(b, n, dtype=torch.long)], dim=1)
    pos = pos_ids(mask)

    def bound() -> int:
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
              use_cache=False, logits_to_keep=n)
        return b * n

    def hf_generate() -> int:
        return b * backend._hf_generate(prompt_ids, prompt_mask, 1.0, n, 0).shape[1]

    return _rates([("KV cache (HFBackend.generate)", cached), ("no cache (naive)", naive),
                   ("forward-only bound", bound), ("HF model.generate (old path)", hf_generate)],
                  args.sample_repeats)


def _rates(fns: list[tuple[str, Any]], repeats: int) -> list[tuple[str, float, int]]:
    """Tokens/s of each fn: best of ``repeats`` timings, the fns interleaved round by round."""
    toks = {name: fn() for name, fn in fns}  # warm-up
    best = {name: float("inf") for name, _ in fns}
    for _ in range(repeats):
        for name, fn in fns:
            t0 = time.perf_counter()
            toks[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return [(name, toks[name] / best[name], toks[name]) for name, _ in fns]


def print_sampling(title: str, res: list[tuple[str, float, int]]) -> None:
    print(f"\n{title}")
    cached, naive, bound = (r[1] for r in res[:3])
    for name, rate, toks in res:
        print(f"  {name:34s} {rate:10.0f} tok/s  ({toks} tokens, {rate / bound:.2f} of bound)")
    print(f"  KV cache / no cache = {cached / naive:.2f}x;  KV cache / forward bound = "
          f"{cached / bound:.2f} (sampling cannot exceed 1)")


# ----------------------------------------------------------------------------- work


def _cpu_sdpa_flops(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward_flops(grad: Any, q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad, q, k, v)


def _onednn_linear_flops(x: Any, w: Any, *_: Any, **__: Any) -> int:
    """grpolab.rollout.packed's oneDNN linear: x [..., K] against a prepacked weight [N, K]."""
    rows = 1
    for d in x[:-1]:
        rows *= d
    return 2 * rows * x[-1] * w[0]


def count_flops(fn: Any) -> int:
    """Matrix-multiplication and attention FLOPs that ``fn()`` performs (forward and backward).

    torch's counter knows the GPU attention kernels; the CPU ones are added with the same
    formulas (every query against every key: masks are not subtracted, for either trainer).
    """
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    counter = FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
        **({torch.ops.mkldnn._linear_pointwise: _onednn_linear_flops}
           if hasattr(torch.ops.mkldnn, "_linear_pointwise") else {}),
    })
    with counter, contextlib.redirect_stdout(io.StringIO()):
        fn()
    return int(counter.get_total_flops())


def trl_step_flops(trainer: Any) -> int:
    """FLOPs of one TRL optimizer step (``train()`` restarts its step count at 0)."""
    trainer.args.max_steps = 1
    return count_flops(trainer.train)


def matmul_rate(args: argparse.Namespace, repeats: int = 20) -> float:
    """FLOP/s of the fastest of a few float32 matmuls: the model's own shapes and a large one.

    The maximum makes work / rate a lower bound on the time any trainer needs for that work.
    """
    tokens = args.batch * args.max_new_tokens
    shapes = [(tokens, args.hidden, args.vocab), (tokens, args.hidden, 4 * args.hidden),
              (1024, 1024, 1024)]
    best = 0.0
    for m, k, n in shapes:
        a, w = torch.randn(m, k), torch.randn(n, k)
        torch.nn.functional.linear(a, w)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(a, w)
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - t0))
    return best


def print_work(flops: dict[str, int], rate: float, res: dict[str, list[dict[str, float]]]) -> None:
    """Counted work per step, the floor it implies on this machine, and how far above it each
    trainer runs."""
    print(f"\nwork per step (matmul and attention FLOPs counted by torch.utils.flop_counter; "
          f"this machine multiplies matrices at {rate / 1e9:.0f} GFLOP/s at this thread count):")
    floor, measured = {}, {}
    for name, f in flops.items():
        rounds = res[name]
        measured[name] = sum(r["time"] for r in rounds) / sum(r["steps"] for r in rounds)
        floor[name] = f / rate
        print(f"  {name:8s} {f / 1e9:8.4g} GFLOP  floor {floor[name] * 1e3:8.4g} ms/step  "
              f"measured {measured[name] * 1e3:8.4g} ms/step = {measured[name] / floor[name]:.2f}x "
              f"its floor")
    if "TRL" in flops:
        print(f"  TRL does {flops['TRL'] / flops['grpolab']:.2f}x grpolab's work; the best "
              f"ratio a trainer doing grpolab's work at its floor could reach against TRL's "
              f"measured time: {measured['TRL'] / floor['grpolab']:.2f}x")


# ----------------------------------------------------------------------------- main


def print_table(res: dict[str, list[dict[str, float]]]) -> None:
    """Wall-clock rates (the headline), CPU-time rates and per-round numbers."""
    print(f"\n{'trainer':11s} {'steps/s':>8s} {'s/step':>7s} {'steps/cpu-s':>11s} "
          f"{'tok/step':>8s} {'width':>5s} {'gen tok/s':>9s}   per-round steps/s")
    wall, cpu, per = {}, {}, {}
    for name, rounds in res.items():
        if not rounds:
            continue
        steps = sum(r["steps"] for r in rounds)
        t, c = sum(r["time"] for r in rounds), sum(r["cpu"] for r in rounds)
        tok = sum(r["tokens"] for r in rounds) / steps
        width = statistics.mean(r["width"] for r in rounds)
        wall[name], cpu[name] = steps / t, steps / c
        per[name] = [r["steps"] / r["time"] for r in rounds]
        print(f"{name:11s} {steps / t:8.3f} {t / steps:7.3f} {steps / c:11.3f} {tok:8.1f} "
              f"{width:5.1f} {tok * steps / t:9.1f}   "
              + ", ".join(f"{x:.3f}" for x in per[name]))
    if "TRL" not in wall:
        return
    rounds = [a / b for a, b in zip(per["grpolab"], per["TRL"])]
    print(f"\nratio grpolab / TRL (steps/s): {wall['grpolab'] / wall['TRL']:.2f}x")
    print(f"  on CPU time (steps per CPU-second, less disturbed by other jobs): "
          f"{cpu['grpolab'] / cpu['TRL']:.2f}x")
    print(f"  per round (wall): {', '.join(f'{x:.2f}' for x in rounds)}; "
          f"median {statistics.median(rounds):.2f}x")
    for name in ("grpolab-hf", "grpolab-old"):
        if name in wall:
            print(f"  {name} / TRL: {wall[name] / wall['TRL']:.2f}x wall, "
                  f"{cpu[name] / cpu['TRL']:.2f}x CPU time")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and trainer")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of a round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved TRL/grpolab rounds")
    p.add_argument("--group-size", type=int, default=8, help="G: answers per prompt")
    p.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=32, help="L: max completion length")
    p.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--preamble-words", type=int, default=0,
                   help="words of a fixed instruction in front of every prompt")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both trainers (0 = torch default)")
    p.add_argument("--sample-batch", type=int, default=256, help="rows for the TinyGPT sampler")
    p.add_argument("--sample-repeats", type=int, default=5)
    p.add_argument("--no-sampling", action="store_true", help="skip the sampling section")
    p.add_argument("--no-trl", action="store_true", help="time grpolab only")
    p.add_argument("--old-path", action="store_true",
                   help="also time grpolab with HF generate and one-pass scoring (grpolab-old)")
    p.add_argument("--hf-forward", action="store_true",
                   help="also time grpolab over the HF forward, without fastlm (grpolab-hf)")
    a = p.parse_args(argv)
    if a.batch % a.group_size:
        p.error(f"--batch {a.batch} must be a multiple of --group-size {a.group_size}")
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "grpolab", "grpolab.rewards.builtin", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="grpolab-bench-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", arch=args.arch, vocab_size=args.vocab,
                                    hidden=args.hidden, layers=args.layers, heads=args.heads,
                                    seed=args.seed)
        rows = make_rows(256, args.seed, args.preamble_words)
        model, tok = load_model(model_dir, device="cpu")
        n_params = sum(p.numel() for p in model.parameters())
        prompt_len = statistics.mean(len(tok(r["prompt"])["input_ids"]) for r in rows)
        del model
        print(f"model: tiny {args.arch}, hidden {args.hidden}, {args.layers} layers, "
              f"{n_params / 1e6:.2f}M params; torch threads {torch.get_num_threads()}")
        print(f"GRPO: G={args.group_size}, {args.batch} completions/step "
              f"({args.batch // args.group_size} prompts of ~{prompt_len:.0f} tokens), "
              f"max {args.max_new_tokens} new tokens, "
              f"beta={args.beta}, lr={args.lr}; {args.rounds} rounds x {args.steps} timed steps "
              f"(+{args.warmup} warm-up) per trainer")

        trl = None if args.no_trl else build_trl(args, model_dir, rows, str(Path(tmp) / "trl"))
        lab = build_lab(args, model_dir, rows, str(Path(tmp) / "lab"))
        old = hfwd = None
        if args.old_path:  # HF generate and one-pass scoring, the code path before the lean loop
            old = build_lab(args, model_dir, rows, str(Path(tmp) / "old"))
            old.backend._lean = False
        if args.hf_forward:  # the lean loop over the HF forward, the code path before fastlm
            hfwd = build_lab(args, model_dir, rows, str(Path(tmp) / "hf"))
            hfwd.backend._fast = hfwd.backend._fast_ref = None
        res: dict[str, list[dict[str, float]]] = {"TRL": [], "grpolab": [], "grpolab-hf": [],
                                                  "grpolab-old": []}
        for _ in range(args.rounds):
            if trl is not None:
                res["TRL"].append(run_trl_round(*trl, args))
            res["grpolab"].append(run_lab_round(lab, args))
            if hfwd is not None:
                res["grpolab-hf"].append(run_lab_round(hfwd, args))
            if old is not None:
                res["grpolab-old"].append(run_lab_round(old, args))

        print_table(res)
        flops = {"grpolab": count_flops(lab.step)}
        if trl is not None:
            flops = {"TRL": trl_step_flops(trl[0]), **flops}
        print_work(flops, matmul_rate(args), res)

        if not args.no_sampling:
            print_sampling(f"sampling, grpolab TinyGPT (TinyConfig defaults, random init), "
                           f"B={args.sample_batch}:", world_sampling(args))
            print_sampling(f"sampling, tiny HF {args.arch}, B={args.batch}, "
                           f"L={args.max_new_tokens}:", hf_sampling(args, model_dir, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
