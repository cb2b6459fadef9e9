"""Streaming several answers at once through a Generate API client."""

import threading


def stream_concurrently(client, prompts: dict, max_tokens: int) -> dict:
    """Streams every prompt of {key: prompt token ids} at once, one thread each; returns
    {key: the list of chunks streamed}."""
    results = {}

    def run(key):
        results[key] = list(client.stream(prompts[key], max_tokens=max_tokens))

    threads = [threading.Thread(target=run, args=(key,)) for key in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def token_ids(chunks) -> list[int]:
    """The token ids of streamed chunks, in order."""
    return [t for chunk in chunks for t in chunk.token_ids]
