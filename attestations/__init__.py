"""The DVBench Django app: experiments, uploads, transcripts, jobs, certificates, the log."""
