"""Where a request can go: the schedulers, embedders and tokenizer the gateway knows, their health,
the models they serve and how a request is routed among them."""
