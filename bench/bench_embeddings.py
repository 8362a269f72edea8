"""Benchmark: embeddings/s through `POST /v1/embeddings` of the real server against
sentence-transformers' `encode` on the same model (all-MiniLM-L6-v2), same run.

Not a test. The server runs the embedding default (float32, like sentence-transformers).
Each HTTP request carries one sentence, sent by keep-alive HTTP/1.1 clients written on
raw asyncio streams (so the client costs little of the 2 cores it shares with the
server); "batch 1" is one client sending one request after another, "32 concurrent" is 32
such clients. sentence-transformers encodes the same sentences in this process: one at a
time, and in batches of 32. Rounds interleave the two sides so a busy machine slows both
alike; the medians are reported.

Target: at 32 concurrent clients, at least 0.8x sentence-transformers' batched
throughput, despite HTTP.

sentence-transformers is not a dependency of the gateway: on first use it is installed
with pip into bench/.deps (without its dependencies' resolver, which would downgrade
huggingface_hub under transformers; the few modules it imports are listed here).

    .venv/bin/python bench/bench_embeddings.py [--rounds 3] [--sentences 512]
        [--concurrency 32] [--encoding-format float]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.models.info.paths import default_embedding_model_path  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

DEPS = Path(__file__).resolve().parent / ".deps"
REFERENCE = ["sentence-transformers==6.0.1", "scikit-learn", "scipy", "joblib", "threadpoolctl",
             "cloudpickle", "narwhals"]
WORDS = ("the a model server request token plugin engine batch cache vector search query "
         "document embedding fast slow river mountain city night morning coffee market "
         "price user answer question python library network memory thread process").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    """`count` sentences of 8 to 24 words (about 10 to 30 tokens each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))).capitalize() + "."
            for _ in range(count)]


def load_reference() -> object:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(DEPS))
        try:
            import sentence_transformers  # noqa: F401
        except ImportError:
            print(f"Installing sentence-transformers into {DEPS} ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--target", str(DEPS), *REFERENCE], check=True)
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(default_embedding_model_path()), device="cpu")


# ------------------------------------------------------------------ the HTTP side
async def _client(port: int, bodies: list[bytes], counter: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for body in bodies:
            writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: bench\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {head[:40]!r}")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            counter[0] += 1
    finally:
        writer.close()


async def http_rate(port: int, texts: list[str], concurrency: int, encoding: str) -> float:
    """Embeddings/s with `concurrency` clients, each sending its share of `texts`."""
    bodies = [json.dumps({"input": t, "encoding_format": encoding}).encode() for t in texts]
    shares = [bodies[i::concurrency] for i in range(concurrency)]
    counter = [0]
    start = time.perf_counter()
    await asyncio.gather(*(_client(port, share, counter) for share in shares))
    elapsed = time.perf_counter() - start
    assert counter[0] == len(texts), counter
    return len(texts) / elapsed


# ------------------------------------------------------------------ the reference side
def reference_rate(model: object, texts: list[str], batch_size: int) -> float:
    encode = model.encode  # type: ignore[attr-defined]
    start = time.perf_counter()
    if batch_size == 1:
        for text in texts:
            encode([text], batch_size=1)
    else:
        encode(texts, batch_size=batch_size)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    args = parser.parse_args()
    texts = sentences(args.sentences)
    single = texts[: max(32, args.sentences // 8)]
    reference = load_reference()
    results: dict[str, list[float]] = {k: [] for k in ("http1", "httpN", "ref1", "refN")}
    with ServerProcess(["all-MiniLM-L6-v2", "--disable-uvicorn-access-log",
                        "--disable-log-stats"]) as server:
        port = server.port
        asyncio.run(http_rate(port, texts[:64], 8, args.encoding_format))  # warm-up
        reference_rate(reference, texts[:64], 32)
        for round_index in range(args.rounds):
            results["httpN"].append(asyncio.run(http_rate(
                port, texts, args.concurrency, args.encoding_format)))
            results["refN"].append(reference_rate(reference, texts, 32))
            results["http1"].append(asyncio.run(http_rate(port, single, 1,
                                                          args.encoding_format)))
            results["ref1"].append(reference_rate(reference, single, 1))
            print(f"round {round_index + 1}: " + ", ".join(
                f"{k} {v[-1]:.0f}/s" for k, v in results.items()), flush=True)
    median = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nall-MiniLM-L6-v2, float32, {args.sentences} sentences of 8-24 words, "
          f"encoding_format={args.encoding_format}, medians of {args.rounds} rounds")
    print(f"{'':28}{'gateway HTTP':>14}{'sentence-transformers':>24}{'ratio':>8}")
    print(f"{'batch 1 (one client)':28}{median['http1']:>12.0f}/s{median['ref1']:>22.0f}/s"
          f"{median['http1'] / median['ref1']:>8.2f}")
    print(f"{f'{args.concurrency} concurrent / batch 32':28}{median['httpN']:>12.0f}/s"
          f"{median['refN']:>22.0f}/s{median['httpN'] / median['refN']:>8.2f}")
    ratio = median["httpN"] / median["refN"]
    print(f"\ntarget: {args.concurrency} concurrent >= 0.80x sentence-transformers batched: "
          f"{'met' if ratio >= 0.8 else 'MISSED'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
