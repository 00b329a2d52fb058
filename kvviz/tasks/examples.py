"""The example prompts of the app's Live and Compare tabs: a passkey and a four-key needle (what eviction
loses), a long free-form answer and a short reasoning task (generation past the budget).  Here, not in the
UI, so that benchmarks run on the same prompts without loading Gradio."""

EXAMPLES = {
    "Passkey in a haystack": "There is a passkey hidden in this text. Memorise it. "
    + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 25
    + "The passkey is 7342519. Remember it. 7342519 is the passkey. "
    + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 25
    + "What is the passkey?",
    "Four-key needle": "Remember these numbers. " + " ".join(
        f"The special number for {key} is {value}. " + "Filler sentence about nothing in particular. " * 12
        for key, value in [("apple", 4821937), ("river", 1560382), ("candle", 9074615), ("mirror", 3318270)])
    + "What is the special number for candle?",
    "Long free-form answer": "Write a detailed story, several paragraphs long, about a lighthouse keeper who "
    "finds a message in a bottle and decides to follow its instructions.",
    "Short reasoning": "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many as he has left. "
    "How many sheep does he have now? Think step by step.",
}
