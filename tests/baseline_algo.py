"""The algorithm example of docs/extending.md, verbatim (tests/unit/test_config.py runs it)."""
# ruff: noqa
from dataclasses import dataclass
from esbatch.backends import BACKENDS, SamplingParams
from esbatch.schema import setting
from esbatch.train.lifecycle import Trainer, UpdateAlgorithm
from esbatch.train.problems import evaluate_heldout, load_problems, reward_of
from esbatch.train.schedule import batch_indices

@dataclass
class BaselineConfig:
    batch_size: int = setting(16, "Prompts per update.", ge=1)
    updates: int | None = setting(None, "Training budget in updates (set this or `epochs`).", ge=1)
    epochs: float | None = setting(None, "Training budget in epochs over the training split.", gt=0.0)

class BaselineTrainer(Trainer):
    def __init__(self, cfg): self.cfg, self.gen, self.sec = cfg, None, cfg.section(BaselineConfig)
    def setup(self):  # returns the budget in updates
        backend, batch = BACKENDS.get(self.cfg.backend.name), self.cfg.generation.batch_size
        self.gen = backend.for_inference(self.cfg.model, None, batch)  # a generator; ES: for_es(backend_setup(cfg))
        self.probs = load_problems(self.cfg, self.gen)
        return self.cfg.total_updates(self.n_train)
    n_train = property(lambda self: len(self.probs.train))
    def restore(self, records): return len(records)  # updates the weights hold
    def step(self, t):  # needs reward/mean
        c, p, g = self.cfg, self.probs, self.cfg.generation
        _, idx = batch_indices(c.run.seed, t, self.n_train, self.sec.batch_size)
        sp = SamplingParams(g.temperature, g.top_p, g.max_new_tokens)
        gens = self.gen.generate([p.train_prompts[i] for i in idx], sp, t)
        r = [reward_of(p.task.score(x.text, p.train[i]), c) for x, i in zip(gens, idx)]
        return {"t": t, "metrics": {"reward/mean": sum(r) / len(r)}}
    def save(self, t, final): pass  # every rank
    def evaluate(self): return evaluate_heldout(self.cfg, self.gen, self.probs)  # rank 0
    def close(self): self.gen and self.gen.close()

class Baseline(UpdateAlgorithm):
    name, section, config, multi_rank = "baseline", "baseline", BaselineConfig, False
    resumable = ("updates", "epochs")  # what a resumed run may change
    @classmethod
    def trainer(cls, cfg, session): return BaselineTrainer(cfg)
