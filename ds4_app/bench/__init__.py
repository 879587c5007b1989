"""The benchmark harness (``ds4-app bench``): the seed's method (serving_notes §4).

prompts (fixtures and wave selection) -> runner (fixed-concurrency waves against any
EngineClient) -> metrics (per level) -> compare (A/B/A brackets) -> report (JSON, Markdown, PNG).
``target`` opens the embedded engine or a remote server; ``arms`` runs one arm or a bracket.
"""
