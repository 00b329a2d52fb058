"""The example prompts of the app's Live and Compare tabs: a passkey and a four-key needle (what eviction
loses), a long free-form answer and a short reasoning task (generation past the budget), each but the
free-form one answered right by the default model's full cache (tests/test_landing.py).  Here, not in the
UI, so that benchmarks run on the same prompts without loading Gradio."""

# The passkey example's haystack: varied sentences (kvviz.tasks.synthetic.prose_sentences, seed 1), the passkey
# early in it, where a recency window loses it.  SmolLM2-135M's full cache answers it (assets/landing.py).
PASSKEY = "3254257"
_BEFORE = (
    "A curious child wrote about the windy harbour with great care. Our guide sold the bright lighthouse "
    "on a cold morning. Our guide walked past the bright chapel before the rain began. Our guide "
    "photographed the silver square on a cold morning. A travelling merchant walked past the narrow "
    "bridge before the rain began. The village baker repaired the bright bridge without saying a word."
)
_AFTER = (
    "Our guide sold the quiet lighthouse after a long journey. My neighbour repaired the muddy orchard "
    "before the rain began. The village baker measured the forgotten market while the bells rang. A quiet"
    " librarian remembered the quiet chapel without saying a word. The young painter photographed the "
    "tall garden near the end of summer. A curious child walked past the muddy lighthouse near the end of"
    " summer. The village baker argued over the ancient mill after a long journey. A quiet librarian sold"
    " the quiet harbour for the third time. The night guard painted the ancient garden before the rain "
    "began. Our guide walked past the windy square near the end of summer. The committee argued over the "
    "quiet lighthouse before the rain began. My neighbour measured the quiet lighthouse near the end of "
    "summer. The night guard remembered the tall railway with great care. The young painter measured the "
    "tall bridge near the end of summer. The night guard argued over the quiet mill without saying a "
    "word. The village baker walked past the muddy railway without saying a word. The night guard painted"
    " the muddy railway near the end of summer. A travelling merchant walked past the quiet mill after a "
    "long journey."
)

# The four-key needle's filler, four sentences before each key and after the last (seed 1 too)
KEYS = {"apple": 4821937, "river": 1560382, "candle": 9074615, "mirror": 3318270}  # the four-key needle's
_FILLERS = [
    (
        "The committee described the forgotten orchard on a cold morning. Our guide sold the muddy chapel "
        "without saying a word. A quiet librarian sold the narrow chapel near the end of summer. A curious "
        "child walked past the muddy orchard without saying a word."
    ),
    (
        "A curious child wrote about the ancient bridge before the rain began. The old sailor measured the "
        "narrow chapel without saying a word. The village baker walked past the quiet lighthouse with great "
        "care. Our guide measured the silver railway without saying a word."
    ),
    (
        "My neighbour sold the windy bridge near the end of summer. The night guard wrote about the crowded "
        "orchard on a cold morning. A travelling merchant measured the bright mill without saying a word. The"
        " young painter photographed the tall garden near the end of summer."
    ),
    (
        "A curious child walked past the muddy lighthouse near the end of summer. The village baker argued "
        "over the ancient mill after a long journey. A quiet librarian sold the quiet harbour for the third "
        "time. The night guard painted the ancient garden before the rain began."
    ),
    (
        "Our guide walked past the windy square near the end of summer. The committee argued over the quiet "
        "lighthouse before the rain began. My neighbour measured the quiet lighthouse near the end of summer."
        " The night guard remembered the tall railway with great care."
    ),
]

EXAMPLES = {
    "Passkey in a haystack": "Read this text and find the passkey. " + _BEFORE
    + f" The passkey is {PASSKEY}. Remember it: {PASSKEY}. " + _AFTER
    + "\n\nWhat is the passkey? Answer with the number only.",
    "Four-key needle": "Remember the special numbers in this text. " + " ".join(
        f"{filler} The special number for {key} is {value}." for filler, (key, value) in zip(_FILLERS, KEYS.items()))
    + f" {_FILLERS[-1]}\n\nWhat is the special number for candle? Answer with the number only.",
    "Long free-form answer": "Write a detailed story, several paragraphs long, about a lighthouse keeper who "
    "finds a message in a bottle and decides to follow its instructions.",
    # simple enough that the 135M model's full cache gets it right (12), long enough an answer to fill a budget
    "Short reasoning": "Tom has 6 apples. He doubles them. How many apples does Tom have now? Think step by step.",
}
