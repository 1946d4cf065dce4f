"""`lti audit`: federated LoRA fine-tuning of a pretrained LLM in Flower, every client update attacked.

A Flower `ClientApp` (the workbench's client code) and a Flower `FedAvg` strategy that shows the server's
attacks every update before aggregating; DAGER and a learned inverter on the rounds asked for; a report
folder with leakage over rounds, privacy and utility.
"""
