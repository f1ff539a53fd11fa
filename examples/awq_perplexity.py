"""AWQ against plain rounding: perplexity of the shipped model on held-out stories, in
float, plain 4-bit / 3-bit and AWQ 4-bit / 3-bit (calibrated on other stories).

    python examples/awq_perplexity.py            # ~2 minutes on 2 cores
"""

import argparse
import tempfile
from pathlib import Path

from mlx_tfm.convert.converter import convert
from mlx_tfm.generation.perplexity import perplexity
from mlx_tfm.loading import load

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "mlx_tfm/assets/default-model"))
    parser.add_argument("--calibration", default=str(ROOT / "tests/data/stories260K/samples_calibration.txt"))
    parser.add_argument("--held-out", default=str(ROOT / "tests/data/stories260K/samples_heldout.txt"))
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--sequence-length", type=int, default=128)
    args = parser.parse_args()
    quiet = dict(log=lambda *_: None)
    print(f"{'model':<14} {'perplexity':>22}")
    model, tokenizer = load(args.model)
    print(f"{'float':<14} {perplexity(model, tokenizer, args.held_out, sequence_length=args.sequence_length)}")
    with tempfile.TemporaryDirectory() as folder:
        for bits in (4, 3):
            for method in ("plain", "awq"):
                awq = dict(data=args.calibration, samples=32, sequence_length=args.sequence_length)
                out = convert(args.model, Path(folder) / f"{method}{bits}", quantize=True, q_bits=bits,
                              q_group_size=args.group_size, awq=awq if method == "awq" else None, **quiet)
                model, tokenizer = load(out)
                result = perplexity(model, tokenizer, args.held_out, sequence_length=args.sequence_length)
                print(f"{method + f' {bits}-bit':<14} {result}")


if __name__ == "__main__":
    main()
