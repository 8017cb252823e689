"""Ours against PyTorch in tokens/s, counted the same way on both sides.

Reads the line `torch_llama_reference.py` printed (its log) and the trainer's metrics.csv of the
same shape, and prints one line:

    ours/torch 0.412x: ours 12345 tokens/s, torch 29960 tokens/s, both over steps 1-2 of 3 (...)

Both figures are the timed steps' tokens over their seconds (Σ tokens / Σ seconds), over the
same step indices: the ones PyTorch timed after its --warmup. The trainer's metrics.csv has
each step's processed tokens and rate, so a step's seconds are tokens / rate. (A median of our
per-step rates against PyTorch's total over total favoured ours; timing other steps on the two
sides, ours its two after the first, PyTorch one, compared different work.)

Our per-step rates are printed too: a timed step much slower than the others (tuning or
compilation past the warm-up) shows there. Exits 1, with no ratio, where the trainer's record
lacks a timed step (a run cut at its part's limit) or either file is not what it should be.

    python benches/throughput_ratio.py --torch torch-hf-llama-3.2-1b.log --ours hf-llama-3.2-1b-sp1/metrics.csv
"""

import argparse
import csv
import re
import sys

TORCH_LINE = re.compile(
    r"^torch .*batch=(?P<batch>\d+) seq=(?P<seq>\d+): timed steps (?P<first>\d+)-(?P<last>\d+) of (?P<steps>\d+): "
    r"(?P<rate>[0-9.]+) tokens/s"
)


def torch_figures(path: str) -> dict:
    with open(path) as file:
        for line in file:
            match = TORCH_LINE.match(line.strip())
            if match:
                figures = {key: float(value) if key == "rate" else int(value) for key, value in match.groupdict().items()}
                if not (figures["rate"] > 0 and figures["first"] <= figures["last"]):
                    raise ValueError(f"{path}: PyTorch timed steps {figures['first']}-{figures['last']} at {figures['rate']} tokens/s, nothing to divide by")
                return figures
    raise ValueError(f"{path} has no line `torch ... timed steps A-B of N: R tokens/s` (did the PyTorch run end?)")


def our_steps(path: str) -> dict:
    """Step index -> (processed tokens, seconds) of the training rows (held-out rows have no rate)."""
    steps = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            rate = row.get("tokens_per_second") or ""
            if not rate:
                continue
            tokens, rate = int(row["processed_tokens"]), float(rate)
            if not (rate > 0 and rate != float("inf")):
                raise ValueError(f"{path}: step {row['step']} has the rate {rate}")
            steps[int(row["step"])] = (tokens, tokens / rate)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", required=True, help="the log of torch_llama_reference.py")
    parser.add_argument("--ours", required=True, help="the trainer's metrics.csv of the same shape")
    args = parser.parse_args()
    try:
        torch = torch_figures(args.torch)
        ours = our_steps(args.ours)
    except (OSError, ValueError, KeyError) as error:
        print(f"no ratio: {error}", file=sys.stderr)
        return 1
    timed = range(torch["first"], torch["last"] + 1)
    missing = [step for step in timed if step not in ours]
    if missing:
        print(
            f"no ratio: PyTorch timed steps {timed.start}-{timed.stop - 1} of {torch['steps']}, ours has no row for {missing} "
            f"(its record holds {sorted(ours) or 'no step'}: a run cut at its limit?)",
            file=sys.stderr,
        )
        return 1
    tokens = sum(ours[step][0] for step in timed)
    seconds = sum(ours[step][1] for step in timed)
    rate = tokens / seconds
    per_step = ", ".join(f"{step}: {ours[step][0] / ours[step][1]:.0f}" for step in timed)
    torch_tokens = torch["batch"] * torch["seq"]
    note = ""
    if any(ours[step][0] != torch_tokens for step in timed):
        note = f"; unlike work: ours processed {[ours[step][0] for step in timed]} tokens a step, PyTorch {torch_tokens}"
    print(
        f"ours/torch {rate / torch['rate']:.3f}x: ours {rate:.0f} tokens/s, torch {torch['rate']:.0f} tokens/s, "
        f"both over steps {timed.start}-{timed.stop - 1} of {torch['steps']} (Σ tokens / Σ seconds; ours per step {per_step}){note}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
