"""`kvstore demo`: the whole system on one machine (`run`), and what it prints (`view`)."""
