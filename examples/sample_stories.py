"""Stories sampled from a model, one per line: the calibration and held-out text of the AWQ
check (tests/data/stories260K/samples_*.txt were written by this script).

    python examples/sample_stories.py tests/data/stories260K-hf OUT.txt 40 0
"""

import argparse
import time

import mlx_tfm
from mlx_tfm.generation.sampling import SamplingParams
from mlx_tfm.generation.settings import GenerationSettings
from mlx_tfm.loading import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("output")
    parser.add_argument("count", type=int)
    parser.add_argument("first_seed", type=int)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    start = time.monotonic()
    with open(args.output, "w") as f:
        for i in range(args.count):
            settings = GenerationSettings(max_tokens=250, sampling=SamplingParams(temp=0.9, seed=args.first_seed + i))
            story = mlx_tfm.generate(model, tokenizer, "Once upon a time", settings=settings)
            f.write(story.strip().replace("\n", " ") + "\n")
    print(f"{args.count} stories in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
