"""Hugging Face BERT <-> model_zoo BERT.

Both are post-LN encoders (LayerNorm after each residual sum) with learned absolute
positions, token-type embeddings and an embedding LayerNorm, exact (erf) GELU, an MLM
head ``dense -> GELU -> LayerNorm -> decoder`` tied to the word embeddings with its own
bias, and a pooler ``tanh(dense(h[:, 0]))`` feeding a 2-way classifier. All projections
are ``nn.Linear`` on both sides (``[out, in]``), so every map is a rename
(``Linear``/``LayerNorm`` pairs carry ``.weight`` and ``.bias``):

==========================  ==================================================
ours                        HF (body keys under ``bert.`` in the task classes)
==========================  ==================================================
word_embeddings             ``embeddings.word_embeddings``
position_embeddings         ``embeddings.position_embeddings``
token_type_embeddings       ``embeddings.token_type_embeddings``
embed_ln                    ``embeddings.LayerNorm``
layers.{i}.attn.query       ``encoder.layer.{i}.attention.self.query`` (key, value alike)
layers.{i}.attn.dense       ``encoder.layer.{i}.attention.output.dense``
layers.{i}.ln1              ``encoder.layer.{i}.attention.output.LayerNorm``
layers.{i}.mlp.fc1          ``encoder.layer.{i}.intermediate.dense``
layers.{i}.mlp.fc2          ``encoder.layer.{i}.output.dense``
layers.{i}.ln2              ``encoder.layer.{i}.output.LayerNorm``
mlm_dense / mlm_ln          ``cls.predictions.transform.dense`` / ``.LayerNorm``
mlm_decoder.weight / .bias  ``word_embeddings`` (tied) / ``cls.predictions.decoder.bias``
pooler                      ``pooler.dense``
nsp_head                    ``cls.seq_relationship`` (``classifier`` when reading
                            ``BertForSequenceClassification`` with ``num_labels=2``)
==========================  ==================================================

Read: ``BertForMaskedLM`` (ours with ``nsp=False``), ``BertForPreTraining`` (``nsp=True``,
exact on both outputs), ``BertModel`` and ``BertForSequenceClassification`` (``nsp=True``;
the heads HF lacks -- the MLM transform and bias, and for ``BertModel`` the NSP head --
keep our seeded initial weights). Written: ``BertForPreTraining`` when ``nsp``, else
``BertForMaskedLM``. HF's ``cls.predictions.bias`` and ``decoder.weight`` are the tied
copies of ``decoder.bias`` and the word embeddings.

Config fields ours cannot represent raise a ValueError naming them: ``hidden_act`` other
than ``'gelu'``, ``position_embedding_type`` other than ``'absolute'``,
``is_decoder``/``add_cross_attention``, ``tie_word_embeddings=False``,
``intermediate_size`` not a multiple of ``hidden_size``, a sequence classifier with
``num_labels != 2``. Dropout: ``hidden_dropout_prob``. (HF's ``pad_token_id`` only zeroes
that embedding row's gradient; ours has none, forward is equal.)
"""
from __future__ import annotations

from .family import HFFamily, KeyReader, State, keep_token, linear, read_renamed, register, \
    renames, without_meta

_LAYER = (linear('attn.query', 'attention.self.query') + linear('attn.key', 'attention.self.key')
          + linear('attn.value', 'attention.self.value')
          + linear('attn.dense', 'attention.output.dense')
          + linear('ln1', 'attention.output.LayerNorm') + linear('mlp.fc1', 'intermediate.dense')
          + linear('mlp.fc2', 'output.dense') + linear('ln2', 'output.LayerNorm'))
_EMBED = ([('word_embeddings.weight', 'embeddings.word_embeddings.weight'),
           ('position_embeddings.weight', 'embeddings.position_embeddings.weight'),
           ('token_type_embeddings.weight', 'embeddings.token_type_embeddings.weight')]
          + linear('embed_ln', 'embeddings.LayerNorm'))
_MLM = (linear('mlm_dense', 'cls.predictions.transform.dense')
        + linear('mlm_ln', 'cls.predictions.transform.LayerNorm')
        + [('mlm_decoder.bias', 'cls.predictions.decoder.bias')])
_POOLER = linear('pooler', 'pooler.dense')
_NSP = {'BertForPreTraining': 'cls.seq_relationship', 'BertForSequenceClassification': 'classifier'}
_CLASSES = {'BertForMaskedLM': 'bert.', 'BertForPreTraining': 'bert.',
            'BertForSequenceClassification': 'bert.', 'BertModel': ''}


def _kwargs(c, hf_class: str) -> dict:
    for field, ours in (('hidden_act', 'gelu'), ('position_embedding_type', 'absolute'),
                        ('is_decoder', False), ('add_cross_attention', False),
                        ('tie_word_embeddings', True)):
        if getattr(c, field, ours) != ours:
            raise ValueError(f'our BERT has {field}={ours!r}; HF config has '
                             f'{field}={getattr(c, field)!r}')
    if c.intermediate_size % c.hidden_size:
        raise ValueError(f'intermediate_size={c.intermediate_size} must be a multiple of '
                         f'hidden_size={c.hidden_size}')
    if hf_class == 'BertForSequenceClassification' and c.num_labels != 2:
        raise ValueError(f"our BERT's classifier (nsp_head) has 2 outputs; HF config has "
                         f'num_labels={c.num_labels}')
    return dict(vocab_size=c.vocab_size, max_positions=c.max_position_embeddings,
                hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                mlp_ratio=c.intermediate_size // c.hidden_size, dropout=c.hidden_dropout_prob,
                eps=c.layer_norm_eps, type_vocab_size=c.type_vocab_size,
                nsp=hf_class != 'BertForMaskedLM')


def _pairs(layers: int, nsp_name: str = None, mlm: bool = True, pooler: bool = True):
    """(our key, HF key) pairs, HF body keys without the ``bert.`` prefix."""
    pairs = renames(_EMBED, layers, _LAYER, 'layers.{i}.', 'encoder.layer.{i}.')
    pairs += (_MLM if mlm else []) + (_POOLER if pooler else [])
    return pairs + (linear('nsp_head', nsp_name) if nsp_name else [])


def _to_ours(hf: KeyReader, kwargs: dict) -> State:
    nsp_name = next((n for n in _NSP.values() if n + '.weight' in hf), None)
    pairs = _pairs(kwargs['layers'], nsp_name, mlm='cls.predictions.decoder.bias' in hf,
                   pooler='pooler.dense.weight' in hf)
    state = read_renamed(hf, pairs)
    state['mlm_decoder.weight'] = state['word_embeddings.weight']  # tied
    return state


def _to_hf(state: State, args: dict):
    nsp = args.get('nsp', True)
    hf_class = 'BertForPreTraining' if nsp else 'BertForMaskedLM'
    pairs = _pairs(args['layers'], 'cls.seq_relationship' if nsp else None, pooler=nsp)
    out = {(k if k.startswith('cls.') else 'bert.' + k): state[ours] for ours, k in pairs}
    out['cls.predictions.bias'] = state['mlm_decoder.bias']
    out['cls.predictions.decoder.weight'] = state['word_embeddings.weight']
    return hf_class, out


def _config(args: dict, vocab: int, base: dict):
    import transformers
    dropout = args.get('dropout', 0.1)
    cfg = dict(base, vocab_size=vocab, hidden_size=args['hidden'],
               num_hidden_layers=args['layers'], num_attention_heads=args['heads'],
               intermediate_size=args.get('mlp_ratio', 4) * args['hidden'], hidden_act='gelu',
               hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
               max_position_embeddings=args['max_positions'],
               type_vocab_size=args.get('type_vocab_size', 2),
               layer_norm_eps=args.get('eps', 1e-12), tie_word_embeddings=True)
    cfg['pad_token_id'] = keep_token(cfg.get('pad_token_id', 0), vocab)
    return transformers.BertConfig.from_dict(without_meta(cfg))


FAMILY = register(HFFamily(
    name='BERT', model_type='bert', classes=_CLASSES, kwargs=_kwargs, to_ours=_to_ours,
    to_hf=_to_hf, config=_config,
    vocab_keys=('word_embeddings.weight', 'mlm_decoder.weight', 'mlm_decoder.bias'),
    vocab_of=lambda hf_config: hf_config.vocab_size,
    ignored=(r'cls\.predictions\.bias', r'cls\.predictions\.decoder\.weight',  # tied copies
             r'embeddings\.(position_ids|token_type_ids)'),  # index buffers of older releases
    seeded={'BertModel': ('mlm_dense.', 'mlm_ln.', 'mlm_decoder.bias', 'nsp_head.'),
            'BertForSequenceClassification': ('mlm_dense.', 'mlm_ln.', 'mlm_decoder.bias')}))
