"""Speculation seen through the API: a reply that repeats its context is drafted and
accepted, streamed deltas of several tokens add up to the plain reply, and /metrics
reports drafts and acceptance per proposer."""

import httpx

TEXT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def ask(server, stream: bool) -> str:
    client = server.client()
    messages = [{"role": "user", "content": f"Repeat this line three times: {TEXT}"}]
    options = dict(model=server.model, messages=messages, max_tokens=60, temperature=0)
    if not stream:
        return client.chat.completions.create(**options).choices[0].message.content
    chunks = client.chat.completions.create(**options, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_repeated_text_is_drafted_and_the_stream_matches_the_reply(smol_server):
    accepted_before = summed_metric(smol_server, "kamado_spec_accepted_tokens_total")
    plain = ask(smol_server, stream=False)
    assert ask(smol_server, stream=True) == plain
    assert summed_metric(smol_server, "kamado_spec_accepted_tokens_total") > accepted_before
    text = httpx.get(smol_server.url + "/metrics").text
    for name in (
        "kamado_spec_draft_tokens_total",
        "kamado_spec_verified_drafts_total",
        "kamado_spec_acceptance_rate",
        "kamado_spec_mean_accepted_length",
    ):
        assert name + '{proposer="' in text, name


def summed_metric(server, name: str) -> float:
    """Summed over proposers; 0 before any draft was verified."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
