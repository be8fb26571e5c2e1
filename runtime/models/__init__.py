"""Models as files: where they are, how they are downloaded and loaded, their tokenizers, chat templates and cards."""
