"""A speculative-decoding loop over a Stager and toy numpy models (``dspark-core simulate``)."""
