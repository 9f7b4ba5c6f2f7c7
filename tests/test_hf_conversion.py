"""Hugging Face transformers <-> model_zoo: GPT-2, BERT and ViT compute transformers' own
logits after ``from_hf`` (serial and every tensor mode, GPT under pipeline), and
``save_hf`` (from any layout, padded vocabulary cut back) writes a directory transformers
loads with the same logits.

The HF models are tiny, built locally from a config (no network) with every weight
randomized (HF initializes LayerNorms and biases to constants, which would hide a swapped
map), in eval mode with dropout 0. The vocabulary of 101 is padded in every parallel
layout (1D t=2: 102, 2D / 2.5D q=2: 102, 3D q^2=4: 104). Needs ``transformers`` (in the
'test' extra); without it the tests fail with a message.
"""
import os

import pytest
import torch

from colossal_lite.testing import full_outputs, max_rel_diff, replica_batch, run_distributed
from model_zoo import BERT, GPT, ViT
from model_zoo.hf import gpt_from_hf, gpt_kwargs_from_hf

V = 101        # HF vocabulary: odd, so every split pads it
TOL = 1e-5     # fp32: max |ours - theirs| / max(1, max |theirs|)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # a failure, never a skip: the comparison is the point
        pytest.fail(f'tests/test_hf_conversion.py needs transformers: pip install transformers '
                    f'(or bash scripts/install.sh test); import failed with: {exc}')
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _randomized(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def hf_model(family, cls=None, **cfg):
    """A tiny randomized transformers model of ``family`` ('gpt', 'bert', 'vit')."""
    tf = _transformers()
    if family == 'gpt':
        config = tf.GPT2Config(**dict(dict(vocab_size=V, n_positions=16, n_embd=32, n_layer=2,
                                           n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), **cfg))
        return _randomized(getattr(tf, cls or 'GPT2LMHeadModel')(config))
    if family == 'bert':
        config = tf.BertConfig(**dict(dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=16, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0), **cfg))
        return _randomized(getattr(tf, cls or 'BertForPreTraining')(config))
    config = tf.ViTConfig(**dict(dict(image_size=8, patch_size=2, num_channels=1, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0), **cfg))
    return _randomized(getattr(tf, cls or 'ViTForImageClassification')(config))


def inputs(family, batch=4, seq=8):
    """Our model's positional inputs (HF takes the same as keywords, ``hf_outputs``)."""
    g = torch.Generator().manual_seed(7)
    if family == 'vit':
        return (torch.randn(batch, 1, 8, 8, generator=g),)
    ids = torch.randint(0, V, (batch, seq), generator=g)
    if family == 'gpt':
        return (ids,)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 3:] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2:] = 1
    return ids, mask, types


def hf_outputs(model, family):
    """transformers' logits for ``inputs(family)``, as a list like ``our_outputs``."""
    x = inputs(family)
    with torch.no_grad():
        if family == 'vit':
            return [model(pixel_values=x[0]).logits]
        if family == 'gpt':
            return [model(input_ids=x[0]).logits]
        out = model(input_ids=x[0], attention_mask=x[1], token_type_ids=x[2])
    if hasattr(out, 'prediction_logits'):
        return [out.prediction_logits, out.seq_relationship_logits]
    return [out.logits]


def our_outputs(model, family):
    """Our full logits (gathered over the tensor split) for ``inputs(family)``."""
    with torch.no_grad():
        return full_outputs(model.eval()(*inputs(family)))


def assert_equal_logits(ours, theirs, vocab=None):
    """Equal within TOL; ours may carry padded vocabulary columns, which must be 0."""
    assert len(ours) == len(theirs)
    for mine, ref in zip(ours, theirs):
        if vocab is not None and mine.shape[-1] > vocab:
            assert mine[..., vocab:].abs().max() == 0
            mine = mine[..., :vocab]
        assert max_rel_diff(mine, ref) <= TOL, max_rel_diff(mine, ref)


MODELS = {'gpt': GPT, 'bert': BERT, 'vit': ViT}
VOCAB = {'gpt': V, 'bert': V, 'vit': None}


# ------------------------------------------------------------------ serial
@pytest.mark.parametrize('family, cls', [
    ('gpt', 'GPT2LMHeadModel'), ('bert', 'BertForMaskedLM'), ('bert', 'BertForPreTraining'),
    ('vit', 'ViTForImageClassification')])
def test_serial_logits_equal_transformers_and_save_hf_loads_back(family, cls, tmp_path):
    tf = _transformers()
    hf = hf_model(family, cls)
    ours = MODELS[family].from_hf(hf)
    expected = hf_outputs(hf, family)
    assert_equal_logits(our_outputs(ours, family), expected)
    ours.save_hf(tmp_path)
    assert {'config.json', 'model.safetensors'} <= set(os.listdir(tmp_path))
    back = getattr(tf, cls).from_pretrained(tmp_path, local_files_only=True)
    assert_equal_logits(hf_outputs(back.eval(), family), expected)
    again = MODELS[family].from_hf(str(tmp_path))   # a directory reads like a model
    assert_equal_logits(our_outputs(again, family), expected)


def test_gpt2_logits_equal_after_conversion_with_padded_vocab():
    hf = hf_model('gpt', n_inner=64)
    ours = gpt_from_hf(hf, vocab_size=128).eval()
    ids = inputs('gpt')[0]
    assert ours(ids).shape == (4, 8, 128)
    theirs = hf_outputs(hf, 'gpt')
    assert_equal_logits(our_outputs(ours, 'gpt'), theirs, vocab=V)
    # the conversion is not the identity on a broken map: swapping q and k changes the logits
    state = ours.state_dict()
    state['blocks.0.attn.query.weight'], state['blocks.0.attn.key.weight'] = \
        state['blocks.0.attn.key.weight'], state['blocks.0.attn.query.weight']
    ours.load_state_dict(state)
    assert max_rel_diff(our_outputs(ours, 'gpt')[0][..., :V], theirs[0]) > 1e-3
    assert gpt_from_hf(hf).state_dict()['wte.weight'].shape[0] == V   # the old caller: no pad


def test_headless_and_classifier_classes_load_their_weights(tmp_path):
    """GPT2Model, BertModel, ViTModel and BertForSequenceClassification: the weights HF has
    are loaded, our heads HF lacks keep their seeded weights (copied into the HF task model
    here, which then computes our logits)."""
    tf = _transformers()
    lm = hf_model('gpt')
    assert_equal_logits(our_outputs(GPT.from_hf(lm.transformer), 'gpt'), hf_outputs(lm, 'gpt'))

    pre = hf_model('bert')
    ours = BERT.from_hf(pre.bert)                      # BertModel: MLM head and NSP seeded
    state = ours.state_dict()
    with torch.no_grad():
        for mine, theirs in (('mlm_dense', pre.cls.predictions.transform.dense),
                             ('mlm_ln', pre.cls.predictions.transform.LayerNorm),
                             ('nsp_head', pre.cls.seq_relationship)):
            theirs.weight.copy_(state[mine + '.weight'])
            theirs.bias.copy_(state[mine + '.bias'])
        pre.cls.predictions.bias.copy_(state['mlm_decoder.bias'])
    assert_equal_logits(our_outputs(ours, 'bert'), hf_outputs(pre, 'bert'))

    seq = hf_model('bert', 'BertForSequenceClassification')
    assert_equal_logits(our_outputs(BERT.from_hf(seq), 'bert')[1:], hf_outputs(seq, 'bert'))

    vit = hf_model('vit')
    ours = ViT.from_hf(vit.vit)                        # ViTModel: classifier seeded
    with torch.no_grad():
        vit.classifier.weight.copy_(ours.state_dict()['head.weight'])
        vit.classifier.bias.copy_(ours.state_dict()['head.bias'])
    assert_equal_logits(our_outputs(ours, 'vit'), hf_outputs(vit, 'vit'))
    no_bias = hf_model('vit', qkv_bias=False)          # read as zero q/k/v biases
    assert_equal_logits(our_outputs(ViT.from_hf(no_bias), 'vit'), hf_outputs(no_bias, 'vit'))


@pytest.mark.parametrize('family, cls', [('gpt', 'GPT2LMHeadModel'), ('bert', 'BertForPreTraining'),
                                         ('bert', 'BertForMaskedLM'),
                                         ('vit', 'ViTForImageClassification')])
def test_save_hf_of_a_model_not_read_from_hf(family, cls, tmp_path):
    """``from_preset`` models (e.g. built from a training checkpoint) export too; their own
    vocabulary is the HF one."""
    tf = _transformers()
    torch.manual_seed(0)
    ours = MODELS[family].from_preset('tiny', nsp=cls != 'BertForMaskedLM') \
        if family == 'bert' else MODELS[family].from_preset('tiny')
    ours.save_hf(tmp_path)
    back = getattr(tf, cls).from_pretrained(tmp_path, local_files_only=True).eval()
    assert_equal_logits(hf_outputs(back, family), our_outputs(ours, family))


def test_save_hf_cuts_a_declared_hf_vocabulary(tmp_path):
    """A padded model not read from HF (e.g. a checkpoint of a 50304-row GPT-2) exports the
    rows the user declares as ``model.hf_vocab_size``."""
    tf = _transformers()
    torch.manual_seed(0)
    ours = GPT.from_preset('tiny')                         # vocab_size 256
    ours.hf_vocab_size = V
    ours.save_hf(tmp_path)
    back = tf.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert back.config.vocab_size == V
    assert_equal_logits(hf_outputs(back, 'gpt'), [our_outputs(ours, 'gpt')[0][..., :V]])


# ------------------------------------------------------------------ errors
def test_config_fields_ours_cannot_represent_raise_naming_them():
    tf = _transformers()
    with pytest.raises(ValueError, match='tanh-GELU'):
        gpt_kwargs_from_hf(tf.GPT2Config(activation_function='relu'))
    with pytest.raises(ValueError, match='smaller than the HF vocabulary'):
        gpt_kwargs_from_hf(tf.GPT2Config(vocab_size=300), vocab_size=256)
    cases = [
        (GPT, hf_model('gpt', scale_attn_by_inverse_layer_idx=True), {},
         'scale_attn_by_inverse_layer_idx=True'),
        (GPT, hf_model('gpt', scale_attn_weights=False), {}, 'scale_attn_weights=False'),
        (GPT, hf_model('gpt', tie_word_embeddings=False), {}, 'tie_word_embeddings=False'),
        (GPT, hf_model('gpt'), dict(vocab_size=100), 'vocab_size=100 is smaller'),
        (GPT, hf_model('gpt'), dict(hidden=64), r'override hidden=64 contradicts .* hidden=32'),
        (BERT, hf_model('bert', hidden_act='gelu_new'), {}, "hidden_act='gelu_new'"),
        (BERT, hf_model('bert', 'BertForSequenceClassification', num_labels=3), {},
         'num_labels=3'),
        (BERT, hf_model('gpt'), {}, "model_type='gpt2'"),
        (GPT, hf_model('gpt', 'GPT2ForSequenceClassification'), {},
         'reads .*GPT2LMHeadModel.*; got GPT2ForSequenceClassification'),
        (ViT, hf_model('vit', hidden_act='relu'), {}, "hidden_act='relu'"),
        (ViT, hf_model('vit', intermediate_size=48), {}, 'intermediate_size=48 must be a multiple'),
        (GPT, '/nonexistent/dir', {}, 'is not a directory'),
    ]
    for cls, source, overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            cls.from_hf(source, **overrides)
    cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64)
    cfg.position_embedding_type = 'relative_key'
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        BERT.from_hf(tf.BertForMaskedLM(cfg))
    with pytest.raises(TypeError, match='local directory or a transformers model'):
        GPT.from_hf(42)
    model = GPT.from_preset('tiny')
    with pytest.raises(TypeError, match='save_hf takes a directory path'):
        model.save_hf(None)
    model.hf_vocab_size = 300
    with pytest.raises(ValueError, match='hf_vocab_size=300 exceeds the model vocab_size=256'):
        model.save_hf('/tmp/unused')


# ------------------------------------------------------------------ parallel layouts
def _rank_logits_and_save(rank, sources, directory):
    """On every rank: each family read from HF for the launched layout, its full logits,
    and its ``save_hf`` under ``directory/<family>``."""
    result = {}
    for family, hf in sources.items():
        model = MODELS[family].from_hf(hf, dropout=0.0)
        result[family] = (our_outputs(model, family), model.arch_args.get('vocab_size'))
        model.save_hf(os.path.join(directory, family))
    return result


def _check_layout(world, config, tmp_path, families=('gpt', 'bert', 'vit'), padded=None):
    tf = _transformers()
    sources = {f: hf_model(f) for f in families}
    expected = {f: hf_outputs(m, f) for f, m in sources.items()}
    results = run_distributed(_rank_logits_and_save, world, config, sources, str(tmp_path),
                              timeout=600)
    for family in families:
        for outputs, vocab in (r[family] for r in results):
            assert_equal_logits(outputs, expected[family], vocab=VOCAB[family])
            if VOCAB[family]:
                assert vocab == padded, (family, vocab)
        cls = type(sources[family]).__name__
        back = getattr(tf, cls).from_pretrained(tmp_path / family, local_files_only=True)
        assert back.config.to_dict().get('vocab_size') == VOCAB[family]
        assert_equal_logits(hf_outputs(back.eval(), family), expected[family])


@pytest.mark.parametrize('world, tensor, padded', [
    (2, dict(size=2, mode='1d'), 102),
    (4, dict(size=4, mode='2d'), 102),
    (4, dict(size=4, mode='2.5d', depth=1), 102),
    (8, dict(size=8, mode='2.5d', depth=2), 102),
], ids=['1d', '2d', '2.5d-d1', '2.5d-d2'])
def test_tensor_modes_equal_transformers_and_save_hf(world, tensor, padded, tmp_path):
    _check_layout(world, dict(parallel=dict(tensor=tensor)), tmp_path, padded=padded)


def test_3d_equals_transformers_and_save_hf(tmp_path):
    _check_layout(8, dict(parallel=dict(tensor=dict(size=8, mode='3d'))), tmp_path, padded=104)


def _pipeline_rank(rank, hf, directory):
    """GPT under pipeline=2 x 1D t=2 (x data): stage 0 sends its activation of this replica's
    rows to stage 1 (same tensor rank); stage 1 returns the full logits (replicas' rows
    gathered). Then save_hf gathers both stages to rank 0."""
    from colossal_lite import communication as C
    from colossal_lite.context import ParallelMode, global_context as gpc
    model = GPT.from_hf(hf).eval()
    ids = replica_batch(inputs('gpt')[0])
    with torch.no_grad():
        if gpc.get_local_rank(ParallelMode.PIPELINE) == 0:
            C.send(model(ids), ParallelMode.PIPELINE, dst=1)
            out = None
        else:
            x = C.recv(torch.empty(*ids.shape, 32), ParallelMode.PIPELINE, src=0)
            out = full_outputs(model(ids, stage_input=x))
    model.save_hf(directory)
    return out, sorted(model.state_dict())


@pytest.mark.parametrize('world', [4, 8], ids=['pp2-tp2', 'pp2-tp2-dp2'])
def test_gpt_pipeline_equals_transformers_and_save_hf_gathers_the_stages(world, tmp_path):
    tf = _transformers()
    hf = hf_model('gpt')
    expected = hf_outputs(hf, 'gpt')
    config = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode='1d')), num_microbatches=2)
    results = run_distributed(_pipeline_rank, world, config, hf, str(tmp_path), timeout=600)
    lasts = [out for out, keys in results if out is not None]
    assert len(lasts) == world // 2                        # every stage-1 rank
    for out in lasts:
        assert_equal_logits(out, expected, vocab=V)
    assert all('blocks.1.ln1.weight' not in keys for out, keys in results if out is None)
    back = tf.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert back.config.vocab_size == V
    assert_equal_logits(hf_outputs(back, 'gpt'), expected)
