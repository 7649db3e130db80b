"""Stand-in of ``tensorrt_llm.inputs`` (tests only): just the salt id the connector needs."""
