"""Where the public trace samples are: next to the repository, in ../shared/traces (never copied in)."""
from __future__ import annotations

from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
MOONCAKE_CONV = TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl"
MOONCAKE_SYNTH = TRACES / "mooncake_synthetic" / "synthetic_trace.jsonl"
BURSTGPT_1 = TRACES / "burstgpt_1" / "BurstGPT_1.head400.csv"
BURSTGPT_3 = TRACES / "burstgpt_3" / "BurstGPT_3.head400.csv"
SHAREGPT = TRACES / "etalon_sharegpt" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
ARXIV = TRACES / "etalon_arxiv" / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
BWB = TRACES / "etalon_bwb" / "bwb_stats_llama2_tokenizer_filtered_v2.csv"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
