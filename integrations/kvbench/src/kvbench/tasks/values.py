"""Random needle values and keys, deterministic given a ``random.Random``."""

from __future__ import annotations

import random
import string

ADJECTIVES = (
    "abashed",
    "agreeable",
    "ancient",
    "bitter",
    "brave",
    "breezy",
    "calm",
    "careful",
    "cheerful",
    "clumsy",
    "crooked",
    "curious",
    "dazzling",
    "defiant",
    "delightful",
    "eager",
    "elegant",
    "faithful",
    "fancy",
    "fierce",
    "fragile",
    "gentle",
    "gifted",
    "gleaming",
    "grumpy",
    "handsome",
    "helpful",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "kind",
    "lively",
    "lonely",
    "lucky",
    "mellow",
    "mighty",
    "modest",
    "nervous",
    "noisy",
    "obedient",
    "odd",
    "proud",
    "purple",
    "quiet",
    "rapid",
    "rustic",
    "scarlet",
    "shiny",
    "silly",
    "sleepy",
    "smooth",
    "spiky",
    "steady",
    "tender",
    "thankful",
    "tidy",
    "tired",
    "velvet",
    "vivid",
    "wandering",
    "witty",
    "wooden",
    "zealous",
)
NOUNS = (
    "anchor",
    "apricot",
    "badger",
    "balloon",
    "beacon",
    "biscuit",
    "blanket",
    "bridge",
    "buffalo",
    "cactus",
    "canyon",
    "carpet",
    "castle",
    "cobbler",
    "comet",
    "cricket",
    "crayfish",
    "dolphin",
    "drum",
    "elbow",
    "falcon",
    "feather",
    "fountain",
    "gazelle",
    "glacier",
    "hammer",
    "harbor",
    "hedgehog",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "lemur",
    "lobster",
    "magnet",
    "meadow",
    "mitten",
    "monsoon",
    "mushroom",
    "necklace",
    "octopus",
    "orchard",
    "otter",
    "pebble",
    "pelican",
    "pillow",
    "quartz",
    "rabbit",
    "ribbon",
    "saddle",
    "scooter",
    "spinach",
    "squirrel",
    "teapot",
    "thimble",
    "tornado",
    "trumpet",
    "tulip",
    "umbrella",
    "violin",
    "walrus",
    "whistle",
    "zeppelin",
)


def random_number(rng: random.Random, digits: int) -> str:
    """A ``digits``-digit decimal number without a leading zero."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def random_key(rng: random.Random) -> str:
    """An ``adjective-noun`` key, as in RULER (e.g. ``"abashed-crayfish"``)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_uuid(rng: random.Random) -> str:
    """A UUID-shaped lowercase hex string (8-4-4-4-12)."""
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def random_var_name(rng: random.Random, letters: int = 5) -> str:
    """An upper-case variable name, as in RULER variable tracking (e.g. ``"QWXKE"``)."""
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(letters))


def unique(draw, rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """Draw ``n`` distinct values with ``draw(rng)``, none of them in ``exclude``."""
    out: list[str] = []
    seen = set(exclude)
    for _ in range(1000 * max(n, 1)):
        if len(out) == n:
            return out
        v = draw(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    if len(out) == n:
        return out
    raise RuntimeError(f"could not draw {n} distinct values")
