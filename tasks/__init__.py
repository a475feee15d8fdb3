"""Downstream evaluations of a pretrained GPT checkpoint (`python tasks/main.py --task ...`)."""
