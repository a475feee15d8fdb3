"""Zero-shot GPT evaluation: WIKITEXT103 (perplexity) and LAMBADA (last-word accuracy).

detokenizer.py  undoes the tokenisation of the WikiText / PTB / LAMBADA text files
datasets.py     the evaluation samples: sliding windows over a text, LAMBADA examples
evaluate.py     the run: flags, model build + load, the forward-only schedule, the report
"""
