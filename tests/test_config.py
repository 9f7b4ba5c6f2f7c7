"""Config validation: every bad config gives a ConfigError naming key, constraint and value."""
import pytest

from colossal_lite.config import ConfigError, ParallelLayout, load_config, parse_parallel

BAD_CONFIGS = [
    (dict(paralel=dict(pipeline=2)), "did you mean 'parallel'"),
    (dict(parallel=dict(pipline=2)), "did you mean 'pipeline'"),
    (dict(parallel=dict(tensor=dict(size=4, mode='2d', dept=2))), "did you mean 'depth'"),
    (dict(parallel=dict(tensor=dict(size=3, mode='2d'))), '2D tensor parallelism needs'),
    (dict(parallel=dict(tensor=dict(size=4, mode='3d'))), "size' = d*d*d, got 4"),
    (dict(parallel=dict(tensor=dict(size=8, mode='2.5d'))), "needs 'parallel.tensor.depth'"),
    (dict(parallel=dict(tensor=dict(size=12, mode='2.5d', depth=2))), 'got size=12, depth=2'),
    (dict(parallel=dict(tensor=dict(size=4, mode='2d', depth=2))), "applies only to mode '2.5d'"),
    (dict(parallel=dict(tensor=dict(size=2, mode='1d', zigzag=True))),
     "'parallel.tensor.zigzag' applies only to the ring of modes"),
    (dict(parallel=dict(tensor=dict(size=2, mode='sequence', zigzag='yes'))),
     "'parallel.tensor.zigzag' must be True or False, got 'yes'"),
    (dict(parallel=dict(tensor=dict(size=4, mode='4d'))), "got '4d'"),
    (dict(parallel=dict(tensor=dict(size=4))), "needs a 'parallel.tensor.mode'"),
    (dict(parallel=dict(tensor=4)), "must be a dict like"),
    (dict(parallel=dict(pipeline=0)), "'parallel.pipeline' must be a positive integer, got 0"),
    (dict(parallel=dict(pipeline=1.5)), 'got 1.5'),
    (dict(parallel=dict(sequence=2, tensor=dict(size=2, mode='1d'))), 'cannot be combined'),
    (dict(fp16=dict(mode='fp8')), "'fp16.mode' must be one of"),
    (dict(fp16=dict(mode='naive', backoff_factor=2.0)), 'must be in (0, 1), got 2.0'),
    (dict(gradient_accumulation=0), "'gradient_accumulation' must be a positive integer, got 0"),
    (dict(clip_grad_norm=-1.0), "'clip_grad_norm' must be a positive finite number, got -1.0"),
    (dict(num_microbatches='4'), "got '4'"),
    (dict(seed='abc'), "'seed' must be an integer"),
    (dict(backend='mpi'), "'backend' must be 'gloo' or 'nccl'"),
    (dict(timeout=float('inf')), "'timeout' must be a positive finite number of seconds, got inf"),
    (dict(timeout=True), 'got True'),
    (dict(fp16=dict(mode='naive', growth_factor=1)), "'fp16.growth_factor' must be > 1, got 1"),
    (dict(fp16=dict(mode='naive', initial_scale=0.5, min_scale=1)), 'must lie in [min_scale, max_scale] = [1, None]'),
    (dict(fp16=dict(mode='naive', initial_scale=True)), 'got True'),
]


@pytest.mark.parametrize('config, message', BAD_CONFIGS)
def test_bad_config_is_a_clear_error(config, message):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert message in str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize('world, layout, message', [
    (6, dict(tensor=dict(size=4, mode='1d')), 'world size must be divisible by pipeline*tensor = 1*4 = 4, got world size 6'),
    (8, dict(pipeline=3), 'got world size 8'),
    (8, dict(data=2, tensor=dict(size=2, mode='1d')), "'parallel.data' = 2 disagrees with world size 8"),
])
def test_world_size_must_fit_the_layout(world, layout, message):
    with pytest.raises(ConfigError) as info:
        parse_parallel(layout).with_world_size(world)
    assert message in str(info.value)


def test_data_parallel_degree_is_derived():
    layout = parse_parallel(dict(pipeline=2, tensor=dict(size=8, mode='2.5d', depth=2))).with_world_size(32)
    assert layout == ParallelLayout(pipeline=2, tensor=8, mode='2.5d', depth=2, data=2)
    assert layout.tensor_grid == 2
    assert parse_parallel(dict(tensor=dict(size=27, mode='3d'))).tensor_grid == 3


def test_user_constants_pass_and_attribute_access(tmp_path):
    path = tmp_path / 'cfg.py'
    path.write_text("BATCH_SIZE = 8\nparallel = dict(tensor=dict(size=2, mode='1d'))\n"
                    "fp16 = dict(mode='torch')\nimport math\n")
    cfg = load_config(str(path))
    assert cfg.BATCH_SIZE == 8
    assert cfg.parallel.tensor.mode == '1d'
    assert cfg.fp16.mode == 'torch'
    assert 'math' not in cfg


def test_config_file_errors(tmp_path):
    (tmp_path / 'broken.py').write_text('x = = 1\n')
    with pytest.raises(ConfigError, match="could not be run: SyntaxError"):
        load_config(str(tmp_path / 'broken.py'))
    (tmp_path / 'undefined.py').write_text("parallel = dict(tensor=dict(mode=onedee))\n")
    with pytest.raises(ConfigError, match="NameError: name 'onedee' is not defined"):
        load_config(str(tmp_path / 'undefined.py'))
    with pytest.raises(ConfigError, match='not found'):
        load_config(str(tmp_path / 'missing.py'))
    with pytest.raises(ConfigError, match='must be a .py file'):
        load_config(str(tmp_path / 'cfg.yaml'))


def test_config_file_with_a_base(tmp_path):
    (tmp_path / '_job.py').write_text("model = dict(type='gpt', hidden=8)\nclip_grad_norm = 1.0\n")
    (tmp_path / 'run.py').write_text("_base_ = '_job.py'\nclip_grad_norm = 2.0\n"
                                     "parallel = dict(tensor=dict(size=2, mode='1d'))\n")
    cfg = load_config(str(tmp_path / 'run.py'))
    assert cfg.model.hidden == 8 and cfg.clip_grad_norm == 2.0 and cfg.parallel.tensor.size == 2
    (tmp_path / 'loop.py').write_text("_base_ = 'loop.py'\n")
    with pytest.raises(ConfigError, match='include each other in a loop'):
        load_config(str(tmp_path / 'loop.py'))


# ---------------------------------------------------------------------------- typed sections
def test_load_config_parses_every_section_once_into_frozen_settings():
    import dataclasses
    cfg = load_config(dict(parallel=dict(pipeline=dict(size=2, chunks=2), tensor=dict(size=2, mode='1d')),
                           gradient_accumulation=4, clip_grad_norm=0.5,
                           gradient_handler=dict(bucket_mb=2, overlap=False),
                           fp16=dict(mode='naive', initial_scale=2.0 ** 10), zero=dict(stage=2),
                           seed=7, timeout=30))
    s = cfg.settings
    assert s.layout == ParallelLayout(pipeline=2, tensor=2, mode='1d')
    assert (s.pipeline.size, s.pipeline.chunks, s.pipeline.schedule) == (2, 2, 'interleaved')
    assert (s.engine.num_microbatches, s.engine.clip_grad_norm) == (4, 0.5)
    assert s.engine.handler_options() == dict(bucket_bytes=2 * 1024 * 1024, overlap=False)
    assert s.amp.as_dict() == dict(mode='naive', dtype='float16', initial_scale=1024.0)
    assert s.zero.stage == 2
    assert (s.run.seed, s.run.timeout, s.run.backend) == (7, 30.0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.engine.num_microbatches = 2
    assert load_config(cfg) is cfg and cfg.settings is s          # parsed once, kept
    cfg.parallel.tensor.size = 4                                   # a change re-parses
    assert cfg.settings is not s and cfg.settings.layout.tensor == 4


@pytest.mark.parametrize('config, message', [
    (dict(num_microbatches=2, gradient_accumulation=4),
     "'num_microbatches' = 2 and its alias 'gradient_accumulation' = 4 differ"),
    (dict(gradient_handler=dict(bucket_mb=0)), "'gradient_handler.bucket_mb' must be a positive finite number, got 0"),
    (dict(gradient_handler=dict(buckt_mb=1)), "did you mean 'bucket_mb'"),
    (dict(gradient_handler=dict(overlap='yes')), "'gradient_handler.overlap' must be True or False"),
    (dict(gradient_handler=[1]), "'gradient_handler' must be a dict"),
    (dict(parallel=dict(pipeline=dict(size=0))), "'parallel.pipeline.size' must be a positive integer"),
    (dict(zero=dict(stage=4)), "'zero.stage' must be one of [1, 2, 3], got 4"),
])
def test_section_errors_name_key_and_value(config, message):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert message in str(info.value)


def test_the_job_section_is_parsed_on_first_read():
    cfg = load_config(dict(model=dict(type='gpt', hidden=8)))     # no data: fine for a library user
    with pytest.raises(ConfigError, match="needs a 'data' section"):
        cfg.settings.job
    with pytest.raises(ConfigError, match=r"'model.type' = 'nope': 'nope' is not a registered model; "
                                          r"registered: \[.*'gpt'.*\]"):
        load_config(dict(model=dict(type='nope'), data=dict(type='digits'))).settings.job
    with pytest.raises(ConfigError, match="'imports': could not import 'no_such_module_xyz'"):
        load_config(dict(imports=['no_such_module_xyz'], model=dict(type='gpt'))).settings.job
    with pytest.raises(ConfigError, match="'imports' must be a list of module names"):
        load_config(dict(imports='model_zoo', model=dict(type='gpt'))).settings.job
    spec = load_config(dict(model=dict(type='gpt', layers=1), data=dict(type='shakespeare'))).settings.job
    assert (spec.kind, spec.options['layers'], spec.options['hidden'], spec.data.seq_len) == \
        ('gpt', 1, 32, 64)
    with pytest.raises(ConfigError, match="'model.vocab_size' = 100 must be at least 256"):
        load_config(dict(model=dict(type='gpt', vocab_size=100), data=dict(type='shakespeare'))).settings.job
    with pytest.raises(ConfigError, match="'model.img_size' = 16 must be 8 for data type 'digits'"):
        load_config(dict(model=dict(type='vit', img_size=16), data=dict(type='digits'))).settings.job


def test_registered_models_resolve_presets_and_options():
    from colossal_lite.models import get_model, register_model, unregister_model

    def builder(width, depth=1):
        return (width, depth)

    register_model('toy', builder, presets=dict(small=dict(width=4)))
    try:
        entry = get_model('toy')
        assert entry.options('small', dict(depth=3)) == dict(width=4, depth=3)
        with pytest.raises(ValueError, match=r"unknown TOY options \['wdth'\]"):
            entry.options('small', dict(wdth=3))
        with pytest.raises(ValueError, match="unknown TOY preset 'big'"):
            entry.options('big', {})
        with pytest.raises(ValueError, match='already registered'):
            register_model('toy', lambda width: width)
    finally:
        unregister_model('toy')


def test_sequence_parallel_is_an_option_of_1d_only():
    layout = parse_parallel(dict(tensor=dict(size=4, mode='1d', sequence_parallel=True)))
    assert layout.sequence_parallel and layout.with_world_size(8).sequence_parallel
    assert not parse_parallel(dict(tensor=dict(size=4, mode='1d'))).sequence_parallel
    with pytest.raises(ConfigError, match="'parallel.tensor.sequence_parallel' applies to mode "
                                          "'1d'.*got mode '2d'"):
        parse_parallel(dict(tensor=dict(size=4, mode='2d', sequence_parallel=True)))
    with pytest.raises(ConfigError, match="'parallel.tensor.sequence_parallel' must be True or "
                                          "False, got 'yes'"):
        parse_parallel(dict(tensor=dict(size=2, mode='1d', sequence_parallel='yes')))


def test_sequence_layout_is_zigzag_unless_asked_otherwise():
    """``parallel.tensor.zigzag`` (mode 'sequence'): default True, kept through the world size."""
    zigzag = parse_parallel(dict(tensor=dict(size=2, mode='sequence'))).with_world_size(4)
    assert zigzag.zigzag and zigzag.data == 2
    contiguous = parse_parallel(dict(tensor=dict(size=2, mode='sequence', zigzag=False)))
    assert not contiguous.with_world_size(2).zigzag
