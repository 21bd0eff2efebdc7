"""Multiple-choice sets in the MMLU / C-Eval / CMMLU layout: a CSV, JSONL or JSON file whose rows
have `question`, options in columns `A`, `B`, ... and `answer` (the right option's letter).

A question is asked in the model's own chat template, one user turn listing the options; the
model's answer is the option whose letter it finds likeliest as the start of its reply (after
what the template opens every reply with, such as Qwen3's empty think block). With
n_shot, the file's first n_shot rows are asked and answered before each question (as earlier
turns of the conversation) and are not scored.
"""
from __future__ import annotations

import string

from swiftlite.errors import UsageError

INSTRUCTION = "Answer with the letter of the correct option only."


def is_choice_file(first_row) -> bool:
    """A row with a question and options A and B (the answer column is checked later, so that
    a file without one is told so rather than read as a chat set)."""
    return isinstance(first_row, dict) and {"question", "A", "B"} <= set(_named(first_row))


def _named(row: dict) -> dict:
    """`question` and `answer` whatever their case (CMMLU writes Question, Answer)."""
    return {k.lower() if isinstance(k, str) and k.lower() in ("question", "answer") else k: v
            for k, v in row.items()}


def letters_of(row: dict) -> list[str]:
    """The option letters of a row: A, B, ... while the columns go on and are not empty."""
    out = []
    for letter in string.ascii_uppercase:
        value = row.get(letter)
        if value is None or str(value).strip() == "":
            break
        out.append(letter)
    return out


def check_rows(rows: list[tuple[str, dict]], path: str) -> list[dict]:
    """[{question, options: {letter: text}, answer, where}] or a UsageError naming every bad
    row by file:line."""
    problems, out = [], []
    rows = [(where, _named(row)) for where, row in rows]
    if rows and "answer" not in rows[0][1]:
        raise UsageError(f"{path}: a multiple-choice file needs an 'answer' column (the right "
                         f"option's letter); its columns are {', '.join(rows[0][1])}.")
    for where, row in rows:
        letters = letters_of(row)
        answer = str(row.get("answer") or "").strip().upper()
        if not str(row.get("question") or "").strip():
            problems.append(f"{where}: the question is empty")
        elif len(letters) < 2:
            problems.append(f"{where}: fewer than two options (columns A, B, ...)")
        elif answer not in letters:
            problems.append(f"{where}: answer {row.get('answer')!r} is not one of the options "
                            f"{', '.join(letters)}")
        else:
            out.append({"question": str(row["question"]).strip(), "answer": answer,
                        "options": {k: str(row[k]).strip() for k in letters}, "where": where})
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10
                                 else [])
        raise UsageError(f"{len(problems)} bad multiple-choice row(s):\n  " + "\n  ".join(shown))
    return out


def question_text(item: dict) -> str:
    options = "\n".join(f"{k}. {v}" for k, v in item["options"].items())
    return f"{item['question']}\n{options}\n{INSTRUCTION}"


def conversation(item: dict, shots: list[dict]) -> list[dict]:
    """The messages that ask `item`, after the solved `shots`."""
    msgs = []
    for s in shots:
        msgs += [{"role": "user", "content": question_text(s)},
                 {"role": "assistant", "content": s["answer"]}]
    return msgs + [{"role": "user", "content": question_text(item)}]


def prompt_ids(template, conv: list[dict]) -> list[int]:
    """The ids before the letter: the prompt, then what the template opens a reply with (Qwen3's
    empty think block), as a fine-tuned model learned to write before its answer."""
    opening = template.reply_opening(conv)
    return template.encode_prompt(conv) + (
        template.tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else [])


def score(model, template, device: str, items: list[dict], shots: list[dict], batch: int
          ) -> list[dict]:
    """Each item with the model's `choice`, `correct` and the options' log-probabilities."""
    from swiftlite.evaluation.scoring import option_logprobs
    tok = template.tokenizer
    prompts = [prompt_ids(template, conversation(it, shots)) for it in items]
    options = [[tok(k, add_special_tokens=False)["input_ids"] for k in it["options"]]
               for it in items]
    scores = option_logprobs(model, device, prompts, options, tok.pad_token_id, batch)
    out = []
    for it, s in zip(items, scores):
        letters = list(it["options"])
        choice = letters[max(range(len(s)), key=s.__getitem__)]
        out.append({**it, "choice": choice, "correct": float(choice == it["answer"]),
                    "logprobs": dict(zip(letters, s))})
    return out
