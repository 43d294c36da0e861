"""The fixed synthetic corpus the tiny models' tokenizers are trained on
(services/tiny_tokenizer.py): word lists and a seeded generator, so every machine trains the
same tokenizer. It mixes English sentences (with emoji), code, numbers, CJK and accented text
and the Zen of Python, so that byte-level and byte-fallback tokenizers meet multi-byte
characters the way real ones do.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Iterator

_WORDS = """the of and to in is it that was for on are with as be at by this from have or one had
not but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come work
different away again off went old number great tell men say small every found still between
city play toward five using himself usually server token model cache batch request stream""".split()
_FOREIGN = """你好，世界。 今天天气很好。 我们一起学习中文。 这个模型很小，但是很快。
请问，火车站在哪里？ 東京は日本の首都です。 こんにちは、元気ですか？
ありがとうございます。 猫が好きです。
안녕하세요. 감사합니다. 오늘은 날씨가 좋아요. café naïve façade résumé über São Paulo Zürich
España niño crème brûlée Ångström Dvořák Łódź Ελληνικά Привет, мир! Größe straße déjà vu
el niño pequeño está aquí à bientôt Tschüss fjörd smörgåsbord""".split()
_EMOJI = "😀 😂 🎉 👍 🚀 ❤️ 🔥 ✨ 🐍 🌍 👩‍💻 🇫🇷 🙂 💡 ✅ ⭐ 🍕 📦".split()
_CODE = [
    "def {a}_{b}({a}, {b}=None):\n    return {a} + {n}\n",
    "for i in range({n}):\n    total += values[i] * {f}\n",
    'if {a} > {n} and not {b}:\n    print("{a} {b}", {f})\n',
    '{{"id": {n}, "name": "{a}", "score": {f}, "tags": ["{b}"]}}\n',
    "class {A}{B}:\n    def __init__(self):\n        self.{a} = [{n}, {m}]\n",
    "x = {a}.get('{b}', {n}) // {m}  # {a} {b}\n",
    '<div class="{a}">{b} &amp; {a}</div>\n',
    "SELECT {a}, {b} FROM t WHERE id = {n};\n",
]


def synthetic_corpus(num_lines: int = 6000, seed: int = 1234) -> Iterator[str]:
    """English-ish sentences, code, numbers, CJK, accented Latin and emoji (the same each call)."""
    rng = random.Random(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen of Python
        import this
    yield from "".join(this.d.get(c, c) for c in this.s).splitlines()
    makers = (_sentence, _sentence, _sentence, _code, _numbers, _foreign)
    for _ in range(num_lines):
        yield rng.choice(makers)(rng)


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(4, 16))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_EMOJI))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "!", "?", ",", ":"))


def _code(rng: random.Random) -> str:
    a, b = rng.sample(_WORDS, 2)
    n, m = rng.randint(0, 999), rng.randint(1, 64)
    return rng.choice(_CODE).format(
        a=a, b=b, A=a.title(), B=b.title(), n=n, m=m, f=round(rng.uniform(-10, 10), 3)
    )


def _numbers(rng: random.Random) -> str:
    y, m, d, n = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 99)
    forms = (f"{rng.randint(0, 10**7):,} items", f"{y}-{m:02d}-{d:02d}", f"{m:02d}:{d:02d} +{n}")
    return rng.choice(forms + (f"${rng.uniform(0, 1000):.2f} and {n}%",))


def _foreign(rng: random.Random) -> str:
    parts = rng.choices(_FOREIGN, k=rng.randint(2, 6)) + rng.choices(_EMOJI, k=rng.randint(0, 2))
    rng.shuffle(parts)
    return " ".join(parts)
