"""Prompts written for the demo and the benchmarks: copy-heavy (edit code, summarise a given text) and free chat.

Each prompt is a user message; `chat_tokens` wraps it in the model's chat template.
"""
from __future__ import annotations

CODE_SNIPPETS = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
''',
    '''def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
''',
    '''function formatPrice(amount, currency) {
  const rounded = Math.round(amount * 100) / 100;
  if (currency === "EUR") {
    return rounded.toFixed(2) + " EUR";
  }
  return "$" + rounded.toFixed(2);
}
''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
''',
    '''SELECT customers.name, COUNT(orders.id) AS order_count
FROM customers
LEFT JOIN orders ON orders.customer_id = customers.id
WHERE customers.created_at >= '2024-01-01'
GROUP BY customers.name
ORDER BY order_count DESC;
''',
    '''def retry(func, attempts=3, delay=1.0):
    import time
    last_error = None
    for attempt in range(attempts):
        try:
            return func()
        except Exception as error:
            last_error = error
            time.sleep(delay)
    raise last_error
''',
]

CODE_EDITS = [
    "Rewrite this code with clear comments on every line. Return the full code.",
    "Add type hints to this code and return the complete updated code.",
]

TEXTS = [
    """The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Supporters said the
lanes would make cycling safer and reduce traffic. Shop owners worried that removing parking spaces would
hurt their business. After two hours of debate, the council voted to build the lanes on a trial basis for
six months and to review parking and sales figures at the end of the trial.""",
    """Honeybees communicate the location of food through a waggle dance. A forager that has found flowers
returns to the hive and moves in a figure-eight pattern. The angle of the dance relative to vertical shows
the direction of the food relative to the sun, and the length of the waggle run shows the distance. Other
bees follow the dancer and then fly out to the same flowers.""",
]

TEXT_TASKS = [
    "Summarize the following text in three sentences, reusing its wording.",
    "Rewrite the following text as a bulleted list, keeping the original sentences.",
]

CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between weather and climate?",
    "Give me ideas for a birthday party for a seven-year-old.",
    "Why is the sky blue?",
    "Describe a typical day of a lighthouse keeper.",
    "What should I pack for a weekend hiking trip?",
    "Explain how a bicycle stays upright when it moves.",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the benefits of learning a second language?",
    "Tell me a short story about a robot who learns to paint.",
    "How does recycling help the environment?",
    "What is photosynthesis?",
    "Suggest a plan for a rainy Sunday afternoon.",
]


def copy_heavy_prompts() -> list[str]:
    """16 prompts whose answers copy much of the prompt: code edits and text rewrites."""
    prompts = [f"{edit}\n\n```\n{code}```" for edit in CODE_EDITS for code in CODE_SNIPPETS[:6]]
    prompts += [f"{task}\n\n{text}" for task in TEXT_TASKS for text in TEXTS]
    return prompts


def free_text_prompts() -> list[str]:
    """16 open chat questions (little to copy)."""
    return list(CHAT)


def demo_prompts() -> list[tuple[str, str]]:
    """(label, prompt) for `ngramspec demo`: a code edit, a summary of a given text, free chat."""
    return [
        ("code edit", f"{CODE_EDITS[1]}\n\n```\n{CODE_SNIPPETS[0]}```"),
        ("code edit",
         f"Rename the method `total` to `count_all` and return the full class.\n\n```\n{CODE_SNIPPETS[1]}```"),
        ("summary", f"{TEXT_TASKS[0]}\n\n{TEXTS[0]}"),
        ("chat", CHAT[1]),
        ("chat", CHAT[3]),
    ]


def chat_tokens(tokenizer, message: str) -> list[int]:
    """Token ids of one user turn followed by the assistant prefix, via the tokenizer's chat template."""
    turn = [{"role": "user", "content": message}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    text = f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
