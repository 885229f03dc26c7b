"""The text level, between the service and the engine: a request checked once (request.py, structured.py; run in
one order by checking.py), its text tokenised (tokenizer.py) and its completion built as tokens arrive
(completion.py, token_text.py, packing.py's stop strings); generator.py drives the engine for the service and
batch, beam.py runs beam search beside it, loading.py loads a model name into both."""
