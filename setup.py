"""colossal_lite packaging.

torch is required but never pinned to a build: an existing torch (CUDA or CPU)
satisfies ``torch>=2.1`` and is left alone. On a machine without torch, run
``scripts/install.sh`` first: it installs the CPU wheel instead of the default
CUDA build.

The C++ CPU Adam kernel (csrc/cpu_adam.cpp) is JIT-built on first use (ninja, below, is
what torch's JIT builder drives). ``COLOSSAL_LITE_BUILD_CPU_ADAM=1 pip install ...`` builds
it now instead, as ``colossal_lite._cpu_adam``.
"""
import os

from setuptools import find_packages, setup


def cpu_adam_extension():
    """(ext_modules, cmdclass) building the CPU Adam kernel when asked to, else empty."""
    if os.environ.get('COLOSSAL_LITE_BUILD_CPU_ADAM', '0') != '1':
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension
    ext = CppExtension('colossal_lite._cpu_adam', ['csrc/cpu_adam.cpp'],
                       extra_compile_args=['-O3', '-fno-math-errno', '-fopenmp'],
                       extra_link_args=['-fopenmp'])
    return [ext], {'build_ext': BuildExtension}


EXT_MODULES, CMDCLASS = cpu_adam_extension()

EXTRAS = {
    'test': ['pytest>=7', 'pytest-timeout>=2', 'scikit-learn>=1.3', 'transformers>=4.40',
             'datasets>=2.14', 'tokenizers>=0.15'],
    # data=dict(type='hf', ...): your own text through datasets + tokenizers
    'hf': ['transformers>=4.40', 'datasets>=2.14', 'tokenizers>=0.15'],
    'dev': ['matplotlib>=3.7', 'tqdm>=4.60', 'scikit-learn>=1.3'],
}
EXTRAS['all'] = sorted({dep for deps in EXTRAS.values() for dep in deps})

setup(
    name='colossal_lite',
    version='0.1.0',
    description='Data, pipeline, 1D/2D/2.5D/3D tensor and sequence parallel training on PyTorch',
    packages=find_packages(include=['colossal_lite', 'colossal_lite.*', 'model_zoo', 'model_zoo.*']),
    package_data={'colossal_lite': ['data/shakespeare/*.txt', 'auto/profiles/*.json']},
    python_requires='>=3.9',
    install_requires=['torch>=2.1', 'numpy', 'tqdm', 'ninja', 'scipy>=1.9'],  # scipy: the graph ILP
    extras_require=EXTRAS,
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    entry_points={'console_scripts': ['colossal-lite=colossal_lite.cli:main'],
                  # model packages: the registry of colossal_lite.models imports them on demand
                  'colossal_lite.models': ['model_zoo = model_zoo']},
)
