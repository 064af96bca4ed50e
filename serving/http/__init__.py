"""The HTTP surface over one engine: OpenAI, KServe v2 / Triton and Megatron `/api` dialects,
their request/response schemas, security (API key, size limits) and the FastAPI app assembly
(`serving.http.app.create_app`). The only part of Tessera that imports FastAPI or Starlette.

Kept free of imports so that `serving.http.schemas` (pydantic only) loads without FastAPI.
"""
