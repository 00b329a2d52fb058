"""Retrieval tasks in essay-like prose, and questions over a generated document (issue 43).

The older tasks hide their needles in a repeated noise paragraph (or one fixed sentence grammar), where the
needle is the only sentence unlike the rest: any key-diversity score keeps it, so they cannot tell retrieval
from novelty.  Here the haystack is prose from several seeded generators (:data:`STYLES`): an essay, a local
history, field notes.  Each draws its sentences from a dozen templates of different shape over our own word
lists, mixes in numbers (years, counts, distances) so that a number is not unusual in itself, breaks its text
into paragraphs of varied length, and never repeats a sentence.

Every generator here takes the sample's ``index`` (the sweep passes it; :func:`kvviz.bench.sweep.make_sample`)
and spreads the needle's depth evenly over ``bins`` strata across samples: sample i's needle lies at a depth
drawn uniformly within stratum ``i % bins``.  ``meta`` records ``depth`` (the share of the haystack's sentences
before the needle) and ``depth_bin``, so that quality can be read against depth.  Without an index (a direct
call) the depth is drawn uniformly over [0, 1).
"""

from __future__ import annotations

import random

from .synthetic import Sample, fit

# --- word lists (ours) --------------------------------------------------------------------------------------

_TOWNS = ["Ashcombe", "Brindle Cross", "Carrow", "Dunmere", "Elsworth", "Fallowby", "Greyhithe", "Hollins",
          "Ivel Bridge", "Kettering Moor", "Larkstone", "Marrowdale", "Nethercote", "Oxley", "Pellham", "Quarry End",
          "Rookwood", "Saltmarsh", "Thornbury", "Upwell", "Wendlebury", "Yarrow"]
_TRADES = ["weavers", "tanners", "potters", "ropemakers", "clockmakers", "brewers", "millers", "glaziers",
           "printers", "shipwrights", "coopers", "masons"]
_GOODS = ["wool", "salt", "timber", "slate", "barley", "linen", "copper", "cider", "peat", "iron", "oysters", "hops"]
_PLACES = ["the harbour wall", "the old toll road", "the market hall", "the river crossing", "the chapel yard",
           "the lower fields", "the signal box", "the water meadow", "the quarry path", "the corn exchange",
           "the east gate", "the canal basin", "the long terrace", "the ferry steps"]
_ABSTRACT = ["patience", "memory", "habit", "curiosity", "ambition", "doubt", "craft", "attention", "routine",
             "chance", "trust", "solitude", "ritual", "evidence", "taste", "ambiguity"]
_FIELDS = ["architecture", "cooking", "gardening", "navigation", "bookbinding", "music", "carpentry", "map making",
           "teaching", "translation", "weather forecasting", "bee keeping"]
_THINKERS = ["a retired surveyor", "one of my first teachers", "an engineer I once worked beside",
             "a novelist from the coast", "my grandmother", "a carpenter in the next valley", "a ship's cook",
             "a schoolteacher with forty years behind her", "an old friend who repaired clocks"]
_VERBS_THINK = ["suspect", "have come to believe", "am no longer sure", "would argue", "keep noticing",
                "tend to forget", "was slow to learn", "find it hard to accept"]
_QUALITIES = ["slow", "unglamorous", "repetitive", "quiet", "stubborn", "modest", "patient", "careful", "plain",
              "uneven", "deliberate", "awkward"]
_BIRDS = ["curlew", "heron", "wren", "redshank", "kestrel", "lapwing", "dipper", "stonechat", "oystercatcher",
          "skylark", "nuthatch", "little egret"]
_PLANTS = ["sea campion", "meadowsweet", "bog myrtle", "yellow flag", "thrift", "wild garlic", "cow parsley",
           "gorse", "marsh marigold", "bracken", "heather", "water mint"]
_WEATHER = ["a thin drizzle", "low cloud over the ridge", "a hard frost", "a warm westerly", "bright sun after rain",
            "fog lifting off the estuary", "a sharp north wind", "still, heavy air", "showers from the south"]
_TERRAIN = ["the saltmarsh", "the beech hanger", "the shingle spit", "the upper moor", "the alder carr",
            "the reed bed", "the chalk down", "the mill leat", "the sunken lane", "the dune slack"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_FIRST = ["Ada", "Bram", "Clara", "Dorian", "Edith", "Felix", "Greta", "Hector", "Iris", "Jonas", "Katrin", "Lionel",
          "Maud", "Nils", "Orla", "Piers", "Rosalind", "Silas", "Thea", "Ulric", "Vera", "Walter"]
_LAST = ["Ashby", "Brennan", "Calloway", "Dunning", "Everard", "Fairweather", "Gorman", "Hartley", "Ingram",
         "Jessop", "Kendrick", "Lowther", "Marchbank", "Norcott", "Oakes", "Pemberton", "Quill", "Radley"]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _year(rng: random.Random) -> int:
    return rng.randint(1712, 1968)


# --- sentence templates: one list of functions per style, each a different sentence shape ---------------------

def _essay(rng: random.Random) -> str:
    c = rng.choice
    forms = [
        lambda: f"I {c(_VERBS_THINK)} that {c(_ABSTRACT)} matters more in {c(_FIELDS)} than talent does.",
        lambda: f"When {c(_THINKERS)} first showed me how {c(_FIELDS)} is done, "
                f"the lesson was mostly about {c(_ABSTRACT)}.",
        lambda: f"Most of the work is {c(_QUALITIES)}, and that is rarely what people expect.",
        lambda: f"There is a difference, easy to miss, between {c(_ABSTRACT)} and {c(_ABSTRACT)}.",
        lambda: f"Consider how long it takes to become competent at {c(_FIELDS)}: perhaps {rng.randint(3, 15)} years, "
                f"if the teaching is good.",
        lambda: f"Why should {c(_ABSTRACT)} be so hard to teach?",
        lambda: f"{_cap(c(_THINKERS))} used to say that {c(_FIELDS)} rewards the {c(_QUALITIES)} "
                "and punishes the hurried.",
        lambda: f"In {_year(rng)}, a small book on {c(_FIELDS)} made the same point with fewer words.",
        lambda: "None of this is new, of course.",
        lambda: f"Still, the {c(_QUALITIES)} parts of {c(_FIELDS)} are where {c(_ABSTRACT)} is built.",
        lambda: f"If I had to name one habit worth keeping, it would be {c(_ABSTRACT)} applied to {c(_FIELDS)}.",
        lambda: f"A beginner sees rules; someone with {rng.randint(10, 40)} years behind them sees {c(_ABSTRACT)}.",
        lambda: f"It is tempting, and usually wrong, to treat {c(_ABSTRACT)} as a gift rather than a practice.",
        lambda: f"The same is true, I think, of {c(_FIELDS)} and of {c(_FIELDS)}.",
        lambda: f"So the question is not whether {c(_ABSTRACT)} helps, "
                f"but how much of it a {c(_QUALITIES)} week can hold.",
    ]
    return c(forms)()


def _history(rng: random.Random) -> str:
    c = rng.choice
    forms = [
        lambda: f"By {_year(rng)} the {c(_TRADES)} of {c(_TOWNS)} had moved their workshops down to {c(_PLACES)}.",
        lambda: f"The parish records list {rng.randint(12, 480)} households in {c(_TOWNS)} at that time.",
        lambda: f"Trade in {c(_GOODS)} and {c(_GOODS)} kept the town busy through most of the century.",
        lambda: f"{_name(rng)}, a dealer in {c(_GOODS)}, paid for the rebuilding of {c(_PLACES)} in {_year(rng)}.",
        lambda: f"It was not until the railway reached {c(_TOWNS)} "
                f"that the road through {c(_PLACES)} lost its traffic.",
        lambda: f"A fire in {c(_MONTHS)} {_year(rng)} destroyed much of {c(_PLACES)}.",
        lambda: f"According to a letter of {_year(rng)}, the {c(_TRADES)} complained of the price of {c(_GOODS)}.",
        lambda: f"Some of the older houses near {c(_PLACES)} still show the marks of that time.",
        lambda: f"The population fell by almost a {c(['third', 'quarter', 'fifth'])} when the {c(_TRADES)} left.",
        lambda: f"Carts carried {c(_GOODS)} the {rng.randint(4, 38)} miles "
                f"from {c(_TOWNS)} to {c(_TOWNS)} twice a week.",
        lambda: f"Whether the bridge at {c(_TOWNS)} was built of stone or timber is still argued over.",
        lambda: f"In the census of {_year(rng)}, {rng.randint(3, 90)} people gave their trade as {c(_TRADES)[:-1]}.",
        lambda: f"Later accounts, written long after, make the {c(_TRADES)} of {c(_TOWNS)} "
                "sound more prosperous than they were.",
        lambda: f"Among the families who stayed were the {c(_LAST)}s, who kept a shop by {c(_PLACES)}.",
        lambda: f"Little survives from before {_year(rng)} beyond a few deeds and a map.",
    ]
    return c(forms)()


def _nature(rng: random.Random) -> str:
    c = rng.choice
    forms = [
        lambda: f"Walked out along {c(_TERRAIN)} in {c(_WEATHER)}.",
        lambda: f"A {c(_BIRDS)} was feeding at the edge of {c(_TERRAIN)}, "
                f"and it stayed for {rng.randint(2, 40)} minutes.",
        lambda: f"The {c(_PLANTS)} is flowering early this year, about {rng.randint(5, 21)} days ahead of last spring.",
        lambda: f"Counted {rng.randint(3, 160)} {c(_BIRDS)}s on the falling tide.",
        lambda: f"By mid {c(_MONTHS)} the path across {c(_TERRAIN)} is often under water.",
        lambda: f"There was {c(_WEATHER)} all afternoon, so I sat with the flask and watched {c(_TERRAIN)}.",
        lambda: f"No sign of the {c(_BIRDS)} that nested here in {_year(rng)}.",
        lambda: f"Where the {c(_PLANTS)} gives way to {c(_PLANTS)}, the ground becomes soft and sour.",
        lambda: f"The light on {c(_TERRAIN)} changes quickly in {c(_MONTHS)}.",
        lambda: f"Heard a {c(_BIRDS)} calling somewhere beyond {c(_TERRAIN)} but never saw it.",
        lambda: f"I measured the water in the ditch at {rng.randint(4, 70)} centimetres, higher than last week.",
        lambda: f"Patches of {c(_PLANTS)} have spread across what was bare mud {rng.randint(2, 12)} years ago.",
        lambda: f"Is it the grazing or the drainage that keeps the {c(_PLANTS)} from coming back?",
        lambda: f"Home before dark, with {c(_WEATHER)} coming in behind me.",
        lambda: f"A pair of {c(_BIRDS)}s crossed {c(_TERRAIN)} low and fast, "
                f"heading for the {c(['river', 'sea', 'wood', 'hills'])}.",
    ]
    return c(forms)()


STYLES = {"essay": _essay, "history": _history, "nature": _nature}


def prose(rng: random.Random, style: str):
    """An endless stream of distinct sentences in ``style`` (one of :data:`STYLES`, or ``mixed``: a style per
    paragraph), each paragraph's last sentence ending in a paragraph break."""
    if style != "mixed" and style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {', '.join(STYLES)}, mixed")
    seen: set[str] = set()
    while True:
        maker = STYLES[rng.choice(list(STYLES))] if style == "mixed" else STYLES[style]
        length = rng.randint(3, 8)
        made = 0
        while made < length:
            sentence = maker(rng)
            if sentence in seen:
                continue
            seen.add(sentence)
            made += 1
            yield sentence + ("\n\n" if made == length else " ")


def _join(sentences: list[str]) -> str:
    return "".join(sentences).strip()


def _insert(filler: list[str], items: list[str], depths: list[float]) -> list[str]:
    """``filler`` with each item placed before the sentence at its depth (a share of the sentences)."""
    text = list(filler)
    for item, depth in sorted(zip(items, depths), key=lambda pair: -pair[1]):
        text.insert(round(depth * len(text)), item + " ")
    return text


def stratified_depth(rng: random.Random, index: int | None, bins: int, offset: int = 0) -> tuple[float, int | None]:
    """A depth in [0, 1) within stratum ``(index + offset) % bins`` (uniform within it); without an index, a
    uniform depth and no stratum."""
    if index is None:
        return rng.random(), None
    stratum = (index + offset) % bins
    return (stratum + rng.random()) / bins, stratum


def _style(rng: random.Random, style: str, index: int | None) -> str:
    """``rotate``: the haystack styles in turn across samples (a random one without an index)."""
    if style != "rotate":
        return style
    names = list(STYLES)
    return names[index % len(names)] if index is not None else rng.choice(names)


_KEY_NOUNS = ["lantern", "orchard", "compass", "violin", "harbour", "telescope", "glacier", "meadow", "falcon",
              "archive", "beacon", "quarry", "cathedral", "kettle", "ferry", "observatory", "windmill", "canyon"]
_KEY_ADJECTIVES = ["amber", "silent", "northern", "hollow", "crimson", "frozen", "gentle", "distant", "hidden",
                   "iron", "lucky", "velvet"]


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)} {rng.choice(_KEY_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def prose_needle(tokenizer, target_tokens: int, seed: int, style: str = "rotate", bins: int = 10,
                 index: int | None = None, chat: bool = True) -> Sample:
    """A 7-digit number for a two-word key, hidden at a stratified depth in essay-like prose; asked back."""
    rng = random.Random(seed)
    style = _style(rng, style, index)
    key, value = _key(rng), _number(rng)
    depth, stratum = stratified_depth(rng, index, bins)
    needle = f"The special magic number for the {key} is {value}."
    question = (f"Question: What is the special magic number for the {key}?\n"
                f"Answer: The special magic number for the {key} is")

    def build(filler):
        return (f"Read the following text. A special magic number is hidden in it; remember it.\n\n"
                f"{_join(_insert(filler, [needle], [depth]))}\n\n{question}")

    prompt = fit(tokenizer, target_tokens, build, prose(rng, style), chat)
    return Sample("prose_needle", prompt, [value], "whole_match",
                  {"key": key, "depth": depth, "depth_bin": stratum, "style": style, "needle": needle})


def prose_multi_value(tokenizer, target_tokens: int, seed: int, values: int = 2, style: str = "rotate",
                      bins: int = 10, index: int | None = None, chat: bool = True) -> Sample:
    """``values`` numbers for one key scattered in prose; all are asked (RULER's share of them found).

    The first value's depth is stratified over ``bins``; the others sit ``bins // values`` strata on from it
    (cyclically), so that the values of one sample are spread over the text."""
    rng = random.Random(seed)
    style = _style(rng, style, index)
    key = _key(rng)
    numbers = []
    while len(numbers) < values:
        number = _number(rng)
        if number not in numbers:
            numbers.append(number)
    placed = [stratified_depth(rng, index, bins, offset=j * max(1, bins // values)) for j in range(values)]
    depths = [depth for depth, _ in placed]
    needles = [f"One of the special magic numbers for the {key} is {number}." for number in numbers]
    question = (f"Question: What are all the special magic numbers for the {key}?\n"
                f"Answer: The special magic numbers for the {key} are")

    def build(filler):
        return (f"Read the following text. Some special magic numbers are hidden in it; remember them.\n\n"
                f"{_join(_insert(filler, needles, depths))}\n\n{question}")

    prompt = fit(tokenizer, target_tokens, build, prose(rng, style), chat)
    return Sample("prose_multi_value", prompt, numbers, "whole_match",
                  {"key": key, "depth": depths[0], "depths": depths, "depth_bin": placed[0][1], "style": style})


# --- document QA: a generated survey report with people, places and facts --------------------------------------

_ROLES = ["the harbour master", "the schoolteacher", "the district nurse", "the blacksmith", "the postmistress",
          "the miller", "the ferryman", "the innkeeper", "the librarian", "the lock keeper", "the surveyor",
          "the organist"]
# The residents' first names, which no haystack sentence uses, so that the asked person is named once.
_RESIDENTS = ["Agatha", "Barnaby", "Cecily", "Desmond", "Eleanor", "Fergus", "Gwendolyn", "Humphrey", "Isolde",
              "Jasper", "Lavinia", "Mortimer", "Philippa", "Rupert", "Winifred", "Ambrose"]
# (fact sentence, question, answer) makers; each answer is an invented word, so it appears nowhere else.
_SYLLABLES_A = ["Bal", "Cor", "Dun", "Fen", "Gal", "Hav", "Kel", "Lor", "Mab", "Nor", "Pel", "Quen", "Ros", "Tam",
                "Ves", "Wyn"]
_SYLLABLES_B = ["adine", "bury", "corth", "dell", "enmoor", "farrow", "garth", "holm", "ington", "lowe", "mere",
                "ravel", "stow", "thorpe", "ulven", "wick"]


_RESERVED = {word for names in (_TOWNS, _LAST, _FIRST, _RESIDENTS) for name in names for word in name.split()}


def _invented(rng: random.Random, used: set[str]) -> str:
    while True:
        word = rng.choice(_SYLLABLES_A) + rng.choice(_SYLLABLES_B)
        if word not in used and word not in _RESERVED:  # never a word the haystack may use
            used.add(word)
            return word


# (fact, question, the answer's opening): the prompt ends with the opening, so the model completes the answer.
_FACTS = [
    ("{person}, {role}, was born in the village of {answer}.",
     "In which village was {person} born?", "{person} was born in the village of"),
    ("{person}, {role}, named the boat {answer} after an aunt.",
     "What did {person} name the boat?", "{person} named the boat"),
    ("The horse that {person}, {role}, rode to market was called {answer}.",
     "What was the name of the horse that {person} rode to market?",
     "The horse that {person} rode to market was called"),
    ("{person}, {role}, kept the accounts in a ledger marked {answer} on its spine.",
     "What was marked on the spine of {person}'s ledger?", "The spine of {person}'s ledger was marked"),
    ("Every winter {person}, {role}, travelled to the town of {answer} to visit a brother.",
     "To which town did {person} travel every winter?", "Every winter {person} travelled to the town of"),
]


def document_qa(tokenizer, target_tokens: int, seed: int, people: int = 4, bins: int = 10,
                index: int | None = None, chat: bool = True) -> Sample:
    """A generated local survey: ``people`` residents, each with one fact (a birthplace, a boat's name, ...)
    whose answer is an invented word, set among paragraphs of local history and field notes.  One resident's
    fact is asked (at a stratified depth); the others' facts are distractors of the same shape."""
    if people < 1:
        raise ValueError(f"people must be at least 1, got {people}")
    rng = random.Random(seed)
    used: set[str] = set()
    names: list[str] = []
    while len(names) < people:
        candidate = f"{rng.choice(_RESIDENTS)} {rng.choice(_LAST)}"
        if candidate.split()[0] not in {n.split()[0] for n in names}:
            names.append(candidate)
    roles = rng.sample(_ROLES, people)
    facts, questions, openings, answers = [], [], [], []
    for person, role in zip(names, roles):
        template, question, opening = rng.choice(_FACTS)
        answer = _invented(rng, used)
        facts.append(template.format(person=person, role=role, answer=answer))
        questions.append(question.format(person=person))
        openings.append(opening.format(person=person))
        answers.append(answer)
    asked = rng.randrange(people)
    depth, stratum = stratified_depth(rng, index, bins)
    # the distractors anywhere else, at random depths
    depths = [depth if i == asked else rng.random() for i in range(people)]
    facts = [f[0].upper() + f[1:] for f in facts]
    title = f"A Survey of {rng.choice(_TOWNS)} and its People"

    def build(filler):
        return (f"Below is a report. Read it, then answer the question after it.\n\n{title}\n\n"
                f"{_join(_insert(filler, facts, depths))}\n\nQuestion: {questions[asked]}\nAnswer: {openings[asked]}")

    prompt = fit(tokenizer, target_tokens, build, _report(rng), chat)
    return Sample("document_qa", prompt, [answers[asked]], "whole_match",
                  {"person": names[asked], "fact": facts[asked], "depth": depth, "depth_bin": stratum,
                   "distractors": [a for i, a in enumerate(answers) if i != asked]})


def _report(rng: random.Random):
    """A report's body: paragraphs of local history and of field notes, mostly history."""
    history, nature = prose(rng, "history"), prose(rng, "nature")
    while True:
        source = history if rng.random() < 0.6 else nature
        while True:
            sentence = next(source)
            yield sentence
            if sentence.endswith("\n\n"):
                break


TASKS = {"prose_needle": prose_needle, "prose_multi_value": prose_multi_value, "document_qa": document_qa}
