"""Evaluation: text and token windows, the one evaluation loop, tasks, statistics, layer SNR."""
