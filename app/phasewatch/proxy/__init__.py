"""The relay: forwards OpenAI-compatible traffic to the upstream and times every streamed token."""
